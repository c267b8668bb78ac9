"""Importers: released data sets and public benchmarks -> bundles.

Each importer reads the user's own copy of a data set and writes one bundle per environment; nothing
of the source is kept in this repository. Every importer answers with an :class:`ImportReport`.
"""

from envscaler.importers.bfcl import import_bfcl
from envscaler.importers.envscaler_release import ImportReport, LeftOut, import_envscaler
from envscaler.importers.tau_bench import import_tau_bench

__all__ = ["ImportReport", "LeftOut", "import_bfcl", "import_envscaler", "import_tau_bench"]
