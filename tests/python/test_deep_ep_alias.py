"""The opt-in deep_ep alias: `import deep_ep` gives turnout where it is
installed, find_spec sees it, and it never shadows or removes a real DeepEP."""
import os
import subprocess
import sys

import pytest

from turnout import deep_ep_alias

CHECK = """
import importlib.util
spec = importlib.util.find_spec("deep_ep")
assert spec is not None, "find_spec does not see the alias"
import deep_ep, turnout
from deep_ep.utils import EventHandle, EventOverlap
assert deep_ep.Buffer is turnout.Buffer and deep_ep.Config is turnout.Config
assert EventOverlap is turnout.EventOverlap and deep_ep.topk_idx_t is turnout.topk_idx_t
import turnout.utils
assert EventHandle is turnout.utils.EventHandle
print("alias ok", spec.submodule_search_locations[0])
"""


def run(args, pythonpath):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath + [os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env, timeout=120)


def real_deep_ep(folder):
    """A stand-in for a real DeepEP install: a deep_ep package without the marker."""
    package = folder / "deep_ep"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("REAL = True\n")
    return package


def test_installed_alias_is_what_import_deep_ep_gives(tmp_path):
    package = deep_ep_alias.install(str(tmp_path))
    assert package == str(tmp_path / "deep_ep") and deep_ep_alias.is_alias(package)
    out = run(["-c", CHECK], [str(tmp_path)])
    assert out.returncode == 0, out.stderr
    assert f"alias ok {package}" in out.stdout
    # Installing again updates it in place.
    assert deep_ep_alias.install(str(tmp_path)) == package


def test_command_line_install_status_uninstall(tmp_path):
    target = str(tmp_path)
    out = run(["-m", "turnout.deep_ep_alias", "install", "--target", target], [])
    assert out.returncode == 0 and "now gives turnout" in out.stdout, out.stderr
    assert "installed" in deep_ep_alias.status(target)
    out = run(["-m", "turnout.deep_ep_alias", "status", "--target", target], [target])
    assert out.returncode == 0 and "turnout's alias" in out.stdout, out.stdout + out.stderr
    out = run(["-m", "turnout.deep_ep_alias", "uninstall", "--target", target], [])
    assert out.returncode == 0 and "removed" in out.stdout, out.stderr
    assert not (tmp_path / "deep_ep").exists()
    assert deep_ep_alias.uninstall(target) is None


def test_refuses_to_shadow_a_real_deep_ep_on_the_path(tmp_path):
    real = real_deep_ep(tmp_path / "real")
    target = tmp_path / "alias"
    target.mkdir()
    out = run(["-m", "turnout.deep_ep_alias", "install", "--target", str(target)], [str(tmp_path / "real")])
    assert out.returncode == 1, out.stdout
    assert "not turnout's alias" in out.stderr and str(real) in out.stderr, out.stderr
    assert not (target / "deep_ep").exists(), "nothing may be written when it refuses"


def test_refuses_to_overwrite_or_remove_a_real_deep_ep_in_the_target(tmp_path):
    real = real_deep_ep(tmp_path)
    with pytest.raises(deep_ep_alias.AliasError, match="not turnout's alias"):
        deep_ep_alias.install(str(tmp_path))
    with pytest.raises(deep_ep_alias.AliasError, match="leaving it alone"):
        deep_ep_alias.uninstall(str(tmp_path))
    assert (real / "__init__.py").read_text() == "REAL = True\n", "the real package was changed"
    assert not (real / deep_ep_alias.MARKER).exists()


def test_utils_holds_deep_eps_names():
    import turnout.utils

    assert set(turnout.utils.__all__) == {"EventHandle", "EventOverlap"}
    assert issubclass(turnout.utils.EventHandle, __import__("torch").cuda.Event), \
        "an EventHandle must be usable wherever a torch.cuda.Event is"
