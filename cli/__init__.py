"""kdsa.cli: the ``kdsa`` command (``main.py``) and one module per subcommand; argument parsing
and one-line errors only, the work is done by the library packages."""
