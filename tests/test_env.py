"""AXONMPI_* environment variables: one parser, clear errors naming the variable and the valid forms."""
import pytest

from axonmpi import env


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("YES", True), ("on", True),
                                            ("0", False), ("false", False), ("No", False), ("", False)])
def test_bool_forms(monkeypatch, value, expected):
    monkeypatch.setenv("AXONMPI_DISABLE_CUPY", value)
    assert env.get_bool("AXONMPI_DISABLE_CUPY") is expected


def test_disable_cupy_false_keeps_cupy_enabled(monkeypatch):
    # on main, AXONMPI_DISABLE_CUPY=false disabled CuPy (anything but "" or "0" counted as true)
    from axonmpi import backend
    monkeypatch.setenv("AXONMPI_DISABLE_CUPY", "false")
    assert env.get_bool("AXONMPI_DISABLE_CUPY") is False
    monkeypatch.setenv("AXONMPI_DISABLE_CUPY", "maybe")
    backend.get_cupy.cache_clear()
    try:
        with pytest.raises(env.EnvError, match=r"AXONMPI_DISABLE_CUPY='maybe' is not a boolean"):
            backend.get_cupy()
    finally:
        backend.get_cupy.cache_clear()


def test_timeout_with_unit_is_named(monkeypatch):
    from axonmpi.distributed import debug
    monkeypatch.setenv("AXONMPI_DEBUG_TIMEOUT", "5s")
    with pytest.raises(env.EnvError, match=r"AXONMPI_DEBUG_TIMEOUT='5s' is not a number.*no unit"):
        debug._timeout()
    monkeypatch.setenv("AXONMPI_DEBUG_TIMEOUT", "-1")
    with pytest.raises(env.EnvError, match="must be a number > 0"):
        debug._timeout()
    monkeypatch.setenv("AXONMPI_DEBUG_TIMEOUT", "2.5")
    assert debug._timeout() == 2.5


def test_log_level(monkeypatch):
    import axonmpi
    monkeypatch.setenv("AXONMPI_LOG_LEVEL", "verbose")
    with pytest.raises(env.EnvError, match=r"AXONMPI_LOG_LEVEL='VERBOSE' is not a log level; expected one of DEBUG"):
        axonmpi.get_logger("test_env")
    monkeypatch.setenv("AXONMPI_LOG_LEVEL", "warning")
    assert axonmpi.get_logger("test_env").level == 30


def test_unknown_variable_rejected():
    with pytest.raises(KeyError, match="not an axonmpi environment variable"):
        env.get("AXONMPI_DEBUGG")


def test_every_variable_documented_in_one_table():
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    for name in env.VARIABLES:
        assert f"| `{name}` |" in text, f"{name} missing from the table in README.md"


def test_env_imports_nothing_from_axonmpi():
    import ast
    tree = ast.parse(open(env.__file__, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("axonmpi"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("axonmpi") for a in node.names), ast.dump(node)
