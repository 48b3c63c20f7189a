"""Settings: config.toml < environment < CLI flags, validated once, errors that name the key."""

import json

import pytest

from mixbit.server.settings import SettingsError, load_settings, parse_assignment

from .conftest import run_cli


def write(tmp_path, text):
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def test_defaults_are_safe():
    s = load_settings(None, environ={})
    assert s.server.host == "127.0.0.1"
    assert s.server.api_keys == [] and s.server.cors_origins == []
    assert s.model.source == "embedded:tiny-qwen3.5"


def test_precedence_file_env_cli(tmp_path):
    cfg = write(tmp_path, "[server]\nport = 8100\nhost = '0.0.0.0'\n[generation]\ntemperature = 0.1\n")
    env = {"MIXBIT_SERVER_PORT": "8200", "MIXBIT_SERVER_API_KEYS": "a,b"}
    s = load_settings(cfg, cli={"server": {"port": 8300}}, environ=env)
    assert s.server.port == 8300  # CLI beats env beats file
    assert s.server.host == "0.0.0.0"  # file beats default
    assert s.server.api_keys == ["a", "b"]  # env list syntax
    assert s.generation.temperature == 0.1
    s = load_settings(cfg, environ=env)
    assert s.server.port == 8200


def test_repo_config_toml_is_valid_and_matches_defaults():
    from .conftest import ROOT
    from mixbit.server.settings import Settings

    assert load_settings(ROOT / "config.toml", environ={}) == Settings()


@pytest.mark.parametrize("text, needle", [
    ("[server]\nprot = 1\n", "unknown key 'server.prot'"),
    ("[serverr]\nport = 1\n", "unknown section [serverr]"),
    ("[server]\nport = 70000\n", "server.port"),
    ("[server]\nlog_level = 'loud'\n", "'debug', 'info', 'warning' or 'error'"),
    ("[generation]\ncompute_dtype = 'int4'\n", "generation.compute_dtype"),
    ("[generation]\ncpu_activations = 'int4'\n", "generation.cpu_activations"),
    ("[server\n", "not valid TOML"),
])
def test_bad_file_values_name_the_key(tmp_path, text, needle):
    with pytest.raises(SettingsError) as err:
        load_settings(write(tmp_path, text), environ={})
    assert needle in str(err.value)


def test_unknown_key_lists_known_keys(tmp_path):
    with pytest.raises(SettingsError) as err:
        load_settings(write(tmp_path, "[server]\nprot = 1\n"), environ={})
    assert "known keys in [server]: host, port" in str(err.value)


def test_bad_environment_variable_is_named():
    with pytest.raises(SettingsError, match="MIXBIT_SERVER_PROT"):
        load_settings(None, environ={"MIXBIT_SERVER_PROT": "1"})
    with pytest.raises(SettingsError, match="server.port"):
        load_settings(None, environ={"MIXBIT_SERVER_PORT": "eighty"})


def test_parse_assignment():
    assert parse_assignment("server.port=8001") == ("server", "port", 8001)
    assert parse_assignment("server.api_keys=['k1']") == ("server", "api_keys", ["k1"])
    assert parse_assignment("model.source=embedded:tiny-qwen3.5") == ("model", "source", "embedded:tiny-qwen3.5")
    with pytest.raises(SettingsError):
        parse_assignment("port=1")


def test_cli_config_shows_precedence(tmp_path):
    cfg = write(tmp_path, "[server]\nport = 8100\n")
    out = run_cli("config", "--config", str(cfg), "--set", "generation.temperature=0.2",
                  env={"MIXBIT_SERVER_HOST": "127.0.0.2"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["server"]["port"] == 8100 and data["server"]["host"] == "127.0.0.2"
    assert data["generation"]["temperature"] == 0.2
    out = run_cli("config", "--config", str(cfg), "--port", "9000")
    assert json.loads(out.stdout)["server"]["port"] == 9000


def test_cli_bad_setting_is_one_clear_line(tmp_path):
    out = run_cli("config", "--set", "server.port=-5")
    assert out.returncode == 2
    assert "server.port" in out.stderr and "Traceback" not in out.stderr


# What kubelet injects into every pod for a Service named "mixbit" (service links), and what
# Docker's legacy links add: none of it is a setting, and none of it may stop start-up.
KUBELET_MIXBIT = {
    "MIXBIT_SERVICE_HOST": "10.96.0.15", "MIXBIT_SERVICE_PORT": "8000",
    "MIXBIT_SERVICE_PORT_HTTP": "8000", "MIXBIT_PORT": "tcp://10.96.0.15:8000",
    "MIXBIT_PORT_8000_TCP": "tcp://10.96.0.15:8000", "MIXBIT_PORT_8000_TCP_PROTO": "tcp",
    "MIXBIT_PORT_8000_TCP_PORT": "8000", "MIXBIT_PORT_8000_TCP_ADDR": "10.96.0.15",
}


def test_platform_injected_variables_are_ignored_and_named():
    ignored: list[str] = []
    env = {**KUBELET_MIXBIT, "MIXBIT_NAME": "/web/mixbit", "MIXBIT_ENV_FOO": "x",
           # a Service named "mixbit-server": the same shapes inside a known section
           "MIXBIT_SERVER_SERVICE_HOST": "10.96.0.16", "MIXBIT_SERVER_PORT": "tcp://10.96.0.16:8000",
           "MIXBIT_SERVER_PORT_8000_TCP_ADDR": "10.96.0.16",
           "MIXBIT_GENERATION_SEED": "7"}  # a real setting beside them still applies
    s = load_settings(None, environ=env, ignored=ignored)
    assert s.server.port == 8000 and s.generation.seed == 7
    assert set(ignored) == set(env) - {"MIXBIT_GENERATION_SEED"}


def test_unknown_key_in_a_known_section_is_still_an_error():
    with pytest.raises(SettingsError, match="unknown key 'server.prot'"):
        load_settings(None, environ={**KUBELET_MIXBIT, "MIXBIT_SERVER_PROT": "1"})
    with pytest.raises(SettingsError, match="server.port"):  # a value that is no service link
        load_settings(None, environ={"MIXBIT_SERVER_PORT": "http://x"})
