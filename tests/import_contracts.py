"""Two import-linter contract types that the standard ones cannot express.

``module_level_forbidden``
    Like ``forbidden``, but only imports that run when a module is imported count: an import
    written inside a function body runs when the function is called, not when the module is
    loaded. trainforge imports heavy clients (torch, mlflow, kubernetes, ray, boto3) inside the
    functions that use them, precisely so that Airflow's DAG processor, which imports the DAG
    side, never loads them; grimp records those imports like any other, so the standard
    ``forbidden`` contract would report every one of them. What DAG parsing *calls* is checked at
    run time by tests/dags/test_dag_files.py (a DAG-file parse imports no engine client).

``only_imports``
    Everything the source packages import from the root package, directly or not, lies inside
    the source packages or the allowed modules (an allow-list: a new module of the Airflow side
    is forbidden to the trainer without anyone adding it to a list).

Both are registered in pyproject.toml's ``[tool.importlinter]`` ``contract_types`` and run by
tests/test_architecture.py.
"""

from __future__ import annotations

import ast
import importlib.util
from copy import deepcopy
from functools import cache

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


@cache
def _module_level_import_lines(module: str) -> frozenset[int]:
    """Line numbers of the import statements of ``module`` that are not inside a function body
    (module-level, class-level, under ``if``/``try``: all run when the module is imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return frozenset()
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read(), filename=spec.origin)
    lines: set[int] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                lines.add(child.lineno)
            visit(child)

    visit(tree)
    return frozenset(lines)


def _without_function_level_imports(graph: ImportGraph) -> ImportGraph:
    """A copy of ``graph`` keeping only the imports that run when their importer is imported."""
    graph = deepcopy(graph)
    for importer in sorted(graph.modules):
        if graph.is_module_squashed(importer):
            continue  # an external package: grimp does not look inside it
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            details = graph.get_import_details(importer=importer, imported=imported)
            module_level = _module_level_import_lines(importer)
            if not any(d["line_number"] in module_level for d in details):
                graph.remove_import(importer=importer, imported=imported)
    return graph


def _render_chains(chains: list[list[str]]) -> None:
    for chain in chains:
        output.print_error(" -> ".join(chain), bold=False)
    output.new_line()


class ModuleLevelForbiddenContract(Contract):
    """The source modules never load the forbidden modules through module-level imports.

    Configuration options:
        - source_modules:    packages whose import must not load the forbidden modules.
        - forbidden_modules: packages (internal or external) that must not be loaded.
    """

    type_name = "module_level_forbidden"

    source_modules = fields.ListField(subfield=fields.ModuleField())
    forbidden_modules = fields.ListField(subfield=fields.ModuleField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        missing = [m.name for m in self.source_modules if m.name not in graph.modules]
        loaded = _without_function_level_imports(graph)
        chains: list[list[str]] = []
        for source in self.source_modules:
            if source.name in missing:
                continue
            for forbidden in self.forbidden_modules:
                if forbidden.name not in loaded.modules:
                    continue  # nothing imports it at all
                for chain in sorted(loaded.find_shortest_chains(
                        importer=source.name, imported=forbidden.name, as_packages=True)):
                    chains.append(list(chain))
        return ContractCheck(kept=not (chains or missing),
                             metadata={"chains": chains, "missing": missing})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for name in check.metadata["missing"]:
            output.print_error(f"{name} does not exist (expected a package of trainforge)")
        if check.metadata["chains"]:
            output.print("Imports that run when the source modules are imported "
                         "(importer -> imported):")
            _render_chains(check.metadata["chains"])


class OnlyImportsContract(Contract):
    """Within the root package, the source packages import only themselves and the allowed
    modules, directly or through other modules.

    Configuration options:
        - root_package:    the package whose modules are checked (``trainforge``).
        - source_modules:  packages whose internal imports are restricted.
        - allowed_modules: the modules (packages) of the root package they may import; an
                           allowed module that does not exist yet allows nothing.
    """

    type_name = "only_imports"

    root_package = fields.ModuleField()
    source_modules = fields.ListField(subfield=fields.ModuleField())
    allowed_modules = fields.ListField(subfield=fields.ModuleField())

    def _allowed(self, module: str) -> bool:
        inside = [*self.source_modules, *self.allowed_modules]
        return any(module == m.name or module.startswith(m.name + ".") for m in inside)

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        root = self.root_package.name
        chains: list[list[str]] = []
        for source in self.source_modules:
            if source.name not in graph.modules:
                chains.append([source.name, "(does not exist)"])
                continue
            reached = graph.find_upstream_modules(source.name, as_package=True)
            for module in sorted(reached):
                if (module == root or module.startswith(root + ".")) and not self._allowed(module):
                    chain = graph.find_shortest_chain(
                        importer=source.name, imported=module, as_packages=True)
                    chains.append(list(chain) if chain else [source.name, module])
        return ContractCheck(kept=not chains, metadata={"chains": chains})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print("Modules imported outside the allowed ones (importer -> imported):")
        _render_chains(check.metadata["chains"])
