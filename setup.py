"""Package discovery for setuptools (the rest of the metadata is in pyproject.toml).

Packages are found, not listed: every package under ``gemini_dcp/``, the CLI (the top-level
``cli/`` folder, installed as ``gemini_dcp_cli``) and the extension's sources (the top-level
``csrc/``, installed as ``gemini_dcp.ext.csrc`` so that an installed package can build them).
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["gemini_dcp", "gemini_dcp.*"]),
        "gemini_dcp_cli",
        *(f"gemini_dcp_cli.{p}" for p in find_packages("cli")),
        "gemini_dcp.ext.csrc",
    ],
)
