"""Command-line tools (figures, tables, benchmarks), installed as console entry points
(``[project.scripts]`` in pyproject.toml) and runnable from a checkout as ``python -m scripts.<name>``."""
