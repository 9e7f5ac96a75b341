"""The commands of the ``hybrid-build`` CLI that drive ``pipeline``: each parses arguments, calls
library code and prints (``cli.COMMANDS`` lists them)."""
