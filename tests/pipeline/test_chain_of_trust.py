"""One chain of trust: each fault planted in a copy of a real built and validated artifact stops every
link that would pass it on (serve, also --dry-run; publish, through the stand-in Hub; status; validate;
a re-run stage), each with one line naming the file; the build's passing report and its reference
survive a failed validate; ``validate --texts`` is an experiment beside the build's report; the hash
cache re-hashes only what changed (counted at ``core.integrity.hash_file``); and the small-sample
rule for top-1 agreement holds its numbers."""
from __future__ import annotations

import json
import math
import os
import shutil
import threading
from fractions import Fraction
from pathlib import Path

import pytest
from hub_standin import StandInHub

from hybrid_build.core import integrity
from hybrid_build.core.artifact import PROVENANCE, REPORTS, TEXTS_REPORT_PREFIX, VALIDATION_LAST
from hybrid_build.pipeline.cli import main
from hybrid_build.pipeline.commands import publish as publish_command
from hybrid_build.validate.checks import ALPHA, binomial_cdf, rate_test

REPO = "my-org/tiny-hybrid"
VALIDATION, REFERENCE = REPORTS["validation"], REPORTS["reference"]
HOUR_NS = 3600 * 10**9


@pytest.fixture
def chain(validated_artifact, tmp_path) -> Path:
    """A private copy of the built and validated artifact, its work folder (stage manifests, where
    the source is) included."""
    dst = tmp_path / "tiny-hybrid"
    shutil.copytree(validated_artifact, dst)
    (dst / ".hybrid-build" / "artifact-sha256.json").unlink(missing_ok=True)
    return dst


@pytest.fixture
def later(monkeypatch):
    """Check as if an hour had passed since the copy: files written just now are not cached
    (``core.integrity.RACY_NS``), which a test of the cache must step over."""
    monkeypatch.setattr(integrity, "now_ns", lambda: __import__("time").time_ns() + HOUR_NS)


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The names ``core.integrity`` reads and hashes, in the order it does."""
    seen: list[str] = []
    real = integrity.hash_file

    def counting(path, expect):
        seen.append(Path(path).name)
        return real(path, expect)

    monkeypatch.setattr(integrity, "hash_file", counting)
    return seen


@pytest.fixture
def hub(monkeypatch) -> StandInHub:
    from hybrid_build.pipeline.publish import RetryPolicy

    hub = StandInHub()
    monkeypatch.setattr(publish_command, "make_api", lambda: hub)
    monkeypatch.setattr(publish_command, "make_retry", lambda: RetryPolicy(attempts=1, sleep=lambda s: None))
    return hub


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def status(capsys, art: Path) -> dict:
    rc, out, _ = run(capsys, "status", art, "--json")
    data = json.loads(out)
    assert rc == (0 if data["artifact"] is None or data["artifact"]["intact"] else 1)  # 1: files not as bound
    return data


def shards(art: Path) -> list[str]:
    return sorted(n for n in json.loads((art / PROVENANCE).read_text())["files"] if n.endswith(".safetensors"))


def change_byte_in_place(path: Path) -> os.stat_result:
    """Flip one byte in the middle of ``path``, then put its mtime back (ns): same size, same
    mtime, other bytes; only the ctime the kernel sets tells. Returns the stat from before."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(before.st_size // 2)
        b = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    return before


def the_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def build_report_bytes(art: Path) -> dict[str, bytes]:
    return {rel: (art / rel).read_bytes() for rel in VALIDATION.files + REFERENCE.files}


# ------------------------------------------------------------------ a byte changed in place


def test_a_byte_changed_in_place_with_size_and_mtime_restored_stops_every_link(chain, later, hashed, hub, capsys):
    data = status(capsys, chain)  # warms the cache: every file hashed once, by stat
    assert data["artifact"]["intact"] and data["validation"]["state"] == "passed"
    assert data["artifact"]["hashed"] == len(hashed) == data["artifact"]["files"]
    name = shards(chain)[0]
    before = change_byte_in_place(chain / name)
    assert (chain / name).stat().st_ctime_ns != before.st_ctime_ns  # the one field that moved
    kept = build_report_bytes(chain)
    hashed.clear()

    rc, _, err = run(capsys, "serve", chain, "--profile", "base", "--dry-run")
    line = the_line(err)
    assert rc == 1 and name in line and "differs from its provenance" in line and "--force" in line
    assert hashed == [name]  # only the changed file was read again; the others were stat'ed

    rc, _, err = run(capsys, "publish", chain, "--repo-id", REPO)
    assert rc == 1 and name in the_line(err) and hub.calls == [] and hub.sent == []
    rc, _, err = run(capsys, "publish", chain, "--repo-id", REPO, "--dry-run", "--force")
    assert rc == 1 and name in the_line(err)

    data = status(capsys, chain)
    assert not data["artifact"]["intact"] and data["artifact"]["problem"].startswith(f"{name} has other bytes")
    stages = {s["stage"]: s for s in data["stages"]}
    assert {stages[s]["state"] for s in ("assemble", "record", "validate")} == {"stale"}
    assert name in stages["record"]["reason"] and name in stages["validate"]["reason"]
    assert data["validation"]["state"] == "stale" and name in data["validation"]["reason"]

    # validate fails on it: the failure is recorded, the build's report and reference are untouched
    rc, out, _ = run(capsys, "validate", chain, "--no-e2e", "--json")
    report = json.loads(out)
    assert rc == 1 and report["outcome"] == "failed"
    assert report["report_file"] == str(chain / VALIDATION_LAST.named(".md"))
    assert any(f.startswith(f"provenance: {name} has other bytes") for f in report["failures"])
    assert build_report_bytes(chain) == kept
    assert json.loads((chain / VALIDATION_LAST.main).read_text())["provenance_sha256"] == \
        json.loads((chain / VALIDATION.main).read_text())["provenance_sha256"]  # both bound to the build

    v = status(capsys, chain)["validation"]
    assert v["state"] == "failed" and name in v["reason"] and v["finished_at"] and v["report"] == VALIDATION_LAST.main
    rc, _, err = run(capsys, "serve", chain, "--profile", "base", "--dry-run")
    assert rc == 1 and name in the_line(err)
    rc, _, err = run(capsys, "publish", chain, "--repo-id", REPO)
    assert rc == 1 and name in the_line(err) and hub.sent == []

    # a stage re-run on it says so, naming the file, instead of "skipped"
    source = json.loads((chain / ".hybrid-build" / "source.json").read_text())["path"]
    rc, out, err = run(capsys, "run", source, "-o", chain, "--only", "record")
    assert rc == 1 and "skipped" not in out and name in the_line(err) and "--from assemble" in err

    # --force serves it anyway, saying why (verify would still run against the reference)
    rc, out, err = run(capsys, "serve", chain, "--profile", "base", "--dry-run", "--force")
    assert rc == 0 and "vllm serve" in out and the_line(err).startswith("warning: ") and name in err


def test_a_deleted_shard_stops_every_link(chain, hub, capsys):
    name = shards(chain)[-1]
    (chain / name).unlink()
    want = f"{name} is listed in {PROVENANCE} but missing from the artifact"
    rc, _, err = run(capsys, "serve", chain, "--profile", "base", "--dry-run")
    assert rc == 1 and want in the_line(err)
    rc, _, err = run(capsys, "publish", chain, "--repo-id", REPO)
    assert rc == 1 and want in the_line(err) and hub.calls == []
    assert status(capsys, chain)["artifact"]["problem"] == want
    kept = {rel: (chain / rel).read_bytes() for rel in VALIDATION.files}
    rc, _, err = run(capsys, "validate", chain, "--no-e2e", "-q")
    assert rc == 1 and name in err
    assert {rel: (chain / rel).read_bytes() for rel in VALIDATION.files} == kept
    assert status(capsys, chain)["validation"]["state"] == "failed"


def test_a_build_without_its_provenance_is_not_served(chain, capsys):
    (chain / PROVENANCE).unlink()
    rc, _, err = run(capsys, "serve", chain, "--profile", "base", "--dry-run")
    assert rc == 1 and f"no {PROVENANCE}" in the_line(err)


def test_a_fifo_in_place_of_a_shard_is_refused_without_hanging(chain, hub, capsys):
    name = shards(chain)[0]
    (chain / name).unlink()
    os.mkfifo(chain / name)
    said: dict[str, tuple[int, str]] = {}

    def each(label: str, *argv) -> None:
        said[label] = run(capsys, *argv)[0::2]

    commands = [("serve", "serve", chain, "--profile", "base", "--dry-run"),
                ("publish", "publish", chain, "--repo-id", REPO),
                ("status", "status", chain, "--json"),
                ("validate", "validate", chain, "--no-e2e", "-q")]
    finished = threading.Event()

    def all_of_them() -> None:
        try:
            for label, *argv in commands:
                each(label, *argv)
        finally:
            finished.set()

    worker = threading.Thread(target=all_of_them, daemon=True)
    worker.start()
    try:
        # a bound, not a pause: the commands finish in seconds unless one waits on the FIFO
        assert finished.wait(timeout=300), f"hung on the FIFO after {sorted(said)}"
    finally:
        if not finished.is_set():  # release a reader stuck on the FIFO: a writer opens and closes it
            os.close(os.open(chain / name, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(timeout=60)
    fifo = f"{name} is a FIFO, not a regular file"
    for label in ("serve", "publish", "validate"):
        assert said[label][0] == 1 and fifo in said[label][1], (label, said[label])
    assert hub.calls == []
    assert said["status"][0] == 1 and fifo in said["status"][1]


# ------------------------------------------------------------------ validate's records


def test_validate_texts_is_an_experiment_beside_the_build_report(chain, tmp_path, hub, capsys):
    texts = tmp_path / "mine.jsonl"
    texts.write_text("\n".join(json.dumps(t) for t in (
        {"name": "greeting", "text": "Hello there, how are you today? I hope the weather is fine."},
        {"name": "numbers", "text": "One, two, three, four, five, six, seven, eight, nine, ten."})) + "\n")
    kept = build_report_bytes(chain)
    rc, out, _ = run(capsys, "validate", chain, "--texts", texts, "--json")
    report = json.loads(out)
    assert rc in (0, 1)  # the figures are the experiment's; whatever they say, nothing of the build moves
    mine = Path(report["report_file"])
    assert mine.parent == chain / "hybrid_build" and mine.name.startswith(TEXTS_REPORT_PREFIX)
    assert mine.name[len(TEXTS_REPORT_PREFIX):-len(".md")] == report["texts"]["sha256"][:16]
    assert json.loads(mine.with_suffix(".json").read_text())["texts"]["names"] == ["greeting", "numbers"]
    assert build_report_bytes(chain) == kept and not (chain / VALIDATION_LAST.main).exists()
    head = report["lm_head"]["top1_test"]  # the head judged on this sample, its size said
    assert head["n"] == report["lm_head"]["tokens"] and head["fails"] is (head["p_value"] < ALPHA)
    assert status(capsys, chain)["validation"]["state"] == "passed"
    rc, out, _ = run(capsys, "publish", chain, "--repo-id", REPO, "--dry-run", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["validation"] == "passed"
    assert not any(f["path"].startswith(f"hybrid_build/{TEXTS_REPORT_PREFIX}") for f in plan["files"])
    assert run(capsys, "serve", chain, "--profile", "base", "--dry-run")[0] == 0


def test_a_passing_validate_rewrites_the_report_and_leaves_the_stage_done(chain, capsys):
    before = (chain / VALIDATION.main).stat().st_ino
    assert run(capsys, "validate", chain, "-q")[0] == 0  # the same checks as the build's: it replaces it
    assert (chain / VALIDATION.main).stat().st_ino != before  # renamed into place: a new file
    stages = {s["stage"]: s["state"] for s in status(capsys, chain)["stages"]}
    assert stages["validate"] == "done"  # a report never makes its stage stale


# ------------------------------------------------------------------ the hash cache


def test_the_cache_rehashes_only_what_changed(chain, later, hashed, capsys):
    from hybrid_build.core.integrity import check_artifact

    first = check_artifact(chain)
    assert first.intact and first.hashed == first.files == len(hashed) and first.cached == 0
    hashed.clear()
    second = check_artifact(chain)
    assert second.intact and second.cached == second.files and hashed == []
    touched, changed = chain / "config.json", chain / shards(chain)[1]
    os.utime(touched)  # a new mtime, the same bytes: read again, still intact
    change_byte_in_place(changed)
    third = check_artifact(chain)
    assert sorted(hashed) == sorted([touched.name, changed.name]) and third.cached == third.files - 2
    assert list(third.by_file) == [changed.name]
    hashed.clear()
    fourth = check_artifact(chain)  # the changed file's new stat is cached with its new (wrong) hash
    assert hashed == [] and list(fourth.by_file) == [changed.name]


def test_files_just_written_are_not_cached(chain, hashed):
    from hybrid_build.core.integrity import check_artifact

    check_artifact(chain)
    n = len(hashed)
    check_artifact(chain)  # the copy was made just now: its stats could still hide a second write
    assert len(hashed) == 2 * n


# ------------------------------------------------------------------ the small-sample rule


def test_binomial_cdf_is_the_exact_sum():
    for n, p, k in ((42, 0.97, 40), (42, 0.97, 37), (765, 0.97, 729), (765, 0.8, 585), (5, 0.5, 2)):
        q = Fraction(p).limit_denominator(1000)
        exact = sum(Fraction(math.comb(n, i)) * q**i * (1 - q)**(n - i) for i in range(k + 1))
        assert binomial_cdf(k, n, p) == pytest.approx(float(exact), rel=1e-9)


def test_the_small_sample_rule_passes_a_correct_head_on_two_texts():
    # the help example's sample: 2 texts, 42 positions, 40 agreeing against head_min_top1 0.97
    t = rate_test(40 / 42, 42, 0.97)
    assert not t.fails and t.p_value > 0.3 and t.fail_at == 37
    assert rate_test(37 / 42, 42, 0.97).fails and not rate_test(38 / 42, 42, 0.97).fails
    # at the bundled texts' size the bound is tight: 765 positions fail at 36 misses (95.3%)
    assert rate_test(729 / 765, 765, 0.97).fails and not rate_test(730 / 765, 765, 0.97).fails
    one = rate_test(0.0, 1, 0.97)  # even 0/1 is not evidence against 0.97 at alpha 0.01
    assert not one.judged and not one.fails and "too few to judge" in one.note()
    assert rate_test(0.0, 2, 0.97).fails  # 0/2: P = 0.0009
    assert rate_test(float("nan"), 42, 0.97).fails


def test_a_correct_head_fails_at_most_alpha_of_the_time():
    # every count a true rate of exactly t produces, weighted by its chance: the rule's false alarm
    for n, thr in ((42, 0.97), (256, 0.97), (765, 0.8)):
        alarm = sum(math.comb(n, k) * thr**k * (1 - thr)**(n - k) for k in range(n + 1)
                    if rate_test(k / n, n, thr).fails)
        assert alarm <= ALPHA
