"""``eval``: task accuracy through lm-eval, of the artifact in process or of served endpoints, with
the bundled offline task set (``eval_taskset``, ``eval_tasks/``)."""
