"""``gemini-dcp``: the operator's command line tool for gemini_dcp tiers.

Installed as the ``gemini_dcp_cli`` package (directory ``cli/``); run it as
``gemini-dcp ...``, ``python -m gemini_dcp_cli ...`` or
``python -m gemini_dcp_cli.main ...``. Every command is a thin layer over
library functions (the operator API of :mod:`gemini_dcp.ops.inspection`); the Typer app is
``gemini_dcp_cli.main.app``.
"""
