"""Opt-in: ``import deep_ep`` gives turnout, for programs that cannot be changed.

    python -m turnout.deep_ep_alias install   [--target DIR]
    python -m turnout.deep_ep_alias uninstall [--target DIR]
    python -m turnout.deep_ep_alias status    [--target DIR]

``install`` writes a small package named ``deep_ep`` (``deep_ep`` and
``deep_ep.utils``, re-exporting turnout's DeepEP names) into DIR, by default
this interpreter's site-packages, so that ``importlib.util.find_spec("deep_ep")``
finds it as it would find DeepEP. It refuses where ``deep_ep`` already resolves
to anything but this alias, or DIR holds another ``deep_ep``: a real DeepEP is
never shadowed. ``uninstall`` removes only a package this command wrote (it
carries a marker file).
"""
import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import sysconfig
from typing import Dict, List, Optional

NAME = "deep_ep"
MARKER = "TURNOUT_ALIAS"

FILES: Dict[str, str] = {
    "__init__.py": '"""turnout under DeepEP\'s name: written by `python -m turnout.deep_ep_alias install`,\n'
                   'removed by `python -m turnout.deep_ep_alias uninstall`."""\n'
                   "from turnout import Buffer, Config, EventOverlap, topk_idx_t\n"
                   "\n"
                   "from . import utils\n"
                   "\n"
                   '__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "utils"]\n',
    "utils.py": '"""DeepEP\'s deep_ep.utils names, from turnout."""\n'
                "from turnout.utils import EventHandle, EventOverlap\n"
                "\n"
                '__all__ = ["EventHandle", "EventOverlap"]\n',
    MARKER: "This deep_ep package is turnout's alias; `python -m turnout.deep_ep_alias uninstall` removes it.\n",
}


class AliasError(RuntimeError):
    """The alias cannot be installed or removed where asked."""


def default_target() -> str:
    return sysconfig.get_paths()["purelib"]


def is_alias(package_dir: str) -> bool:
    return os.path.isfile(os.path.join(package_dir, MARKER))


def resolved_package(path: Optional[List[str]] = None) -> Optional[str]:
    """The folder ``import deep_ep`` would load (on ``path``, default sys.path), or None."""
    if path is None:
        spec = importlib.util.find_spec(NAME) if NAME not in sys.modules else sys.modules[NAME].__spec__
    else:
        spec = importlib.machinery.PathFinder.find_spec(NAME, path)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return spec.origin or "(a built-in or namespace module)"


def install(target: Optional[str] = None) -> str:
    """Writes the alias into ``target``; returns the package folder."""
    target = os.path.abspath(target or default_target())
    package = os.path.join(target, NAME)
    for found in (resolved_package(), resolved_package([target])):
        if found is not None and not (os.path.isdir(found) and is_alias(found)):
            raise AliasError(f"a {NAME} that is not turnout's alias is importable at {found}; refusing to "
                             f"shadow it (uninstall it first if you mean to replace DeepEP)")
    if os.path.exists(package) and not is_alias(package):
        raise AliasError(f"{package} exists and is not turnout's alias; refusing to overwrite it")
    os.makedirs(package, exist_ok=True)
    for name, text in FILES.items():
        with open(os.path.join(package, name), "w") as f:
            f.write(text)
    return package


def uninstall(target: Optional[str] = None) -> Optional[str]:
    """Removes the alias from ``target``; returns the removed folder, or None if there was none."""
    package = os.path.join(os.path.abspath(target or default_target()), NAME)
    if not os.path.exists(package):
        return None
    if not is_alias(package):
        raise AliasError(f"{package} is not turnout's alias (no {MARKER} file); leaving it alone")
    shutil.rmtree(package)
    return package


def status(target: Optional[str] = None) -> str:
    package = os.path.join(os.path.abspath(target or default_target()), NAME)
    found = resolved_package()
    where = ("turnout's alias" if found and os.path.isdir(found) and is_alias(found) else "not turnout") \
        if found else "nothing"
    alias = "installed" if os.path.isdir(package) and is_alias(package) else "not installed"
    return f"alias in {package}: {alias}; `import {NAME}` loads {found or 'nothing'} ({where})"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnout.deep_ep_alias", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("install", "uninstall", "status"))
    parser.add_argument("--target", default=None, help="the folder (default: this interpreter's site-packages)")
    args = parser.parse_args(argv)
    try:
        if args.action == "install":
            print(f"installed {install(args.target)}: `import {NAME}` now gives turnout")
        elif args.action == "uninstall":
            removed = uninstall(args.target)
            print(f"removed {removed}" if removed else f"no alias in {args.target or default_target()}")
        else:
            print(status(args.target))
    except AliasError as e:
        print(f"turnout.deep_ep_alias: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
