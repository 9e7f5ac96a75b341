"""Stage names, kept apart from the stage code so that the CLI can list them without importing torch."""
STAGES = ("inspect", "calibrate", "quantize-head", "assemble", "validate")
WORK_DIR = ".hybrid-build"
