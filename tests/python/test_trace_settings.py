"""Triton's trace extension as tritonclient speaks it: `get_trace_settings` and
`update_trace_settings` over HTTP and gRPC, server-wide and per model, with Triton's update
and clear semantics and its answers to bad settings (its qa/L0_trace trace_endpoint_test
walks the same steps)."""

import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import Server


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("trace") / "trace.json"
    s = Server(f"--trace-config=triton,file={trace_file}", "--trace-config=level=TIMESTAMPS",
               "--trace-config=rate=1")
    s.trace_file = str(trace_file)
    yield s
    s.stop()


def settings(kind, server, model=None, update=None):
    """The setting as a dict of Triton's keys (gRPC's lists of one value unwrapped but
    trace_level's)."""
    if kind == "http":
        c = httpclient.InferenceServerClient(server.http_url)
        if update is None:
            return c.get_trace_settings(model_name=model)
        return c.update_trace_settings(model_name=model, settings=update)
    c = grpcclient.InferenceServerClient(server.grpc_url)
    if update is None:
        got = c.get_trace_settings(model_name=model, as_json=True)
    else:
        got = c.update_trace_settings(model_name=model, settings=update, as_json=True)
    return {k: v.get("value", []) if k == "trace_level" else v["value"][0]
            for k, v in got["settings"].items()}


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_settings_follow_tritons_update_and_clear_semantics(traced, kind):
    start = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
             "log_frequency": "0", "trace_file": traced.trace_file, "trace_mode": "triton"}
    assert settings(kind, traced) == start
    # A model without its own setting goes by the server-wide one.
    assert settings(kind, traced, "classifier") == start
    model = settings(kind, traced, "classifier", {"trace_rate": "12", "log_frequency": "34"})
    assert (model["trace_rate"], model["log_frequency"]) == ("12", "34")
    glob = settings(kind, traced, None, {"trace_rate": "56", "trace_count": "78", "trace_level": ["OFF"]})
    assert (glob["trace_rate"], glob["trace_count"], glob["trace_level"]) == ("56", "78", ["OFF"])
    # Cleared server-wide fields go back to the arguments' values.
    glob = settings(kind, traced, None, {"trace_rate": None, "trace_count": None})
    assert (glob["trace_rate"], glob["trace_count"], glob["trace_level"]) == ("1", "-1", ["OFF"])
    # The model's own fields stay; the others follow the server-wide ones.
    model = settings(kind, traced, "classifier")
    assert (model["trace_rate"], model["log_frequency"], model["trace_level"]) == ("12", "34", ["OFF"])
    model = settings(kind, traced, "classifier", {"trace_rate": None, "trace_level": None})
    assert (model["trace_rate"], model["log_frequency"]) == ("1", "34")
    # Every field cleared: the model follows the server-wide setting again.
    assert settings(kind, traced, "classifier", {"log_frequency": None}) == settings(kind, traced)
    settings(kind, traced, None, {"trace_level": None})
    assert settings(kind, traced) == start


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_bad_settings_are_refused_in_tritons_words(traced, kind):
    status = {"http": {400: "400", 501: "501"}, "grpc": {400: "StatusCode.INVALID_ARGUMENT",
                                                         501: "StatusCode.UNIMPLEMENTED"}}[kind]
    for model, update, code, words in [
        (None, {"trace_file": "other.json"}, 501, "trace file location can not be updated"),
        (None, {"trace_level": ["OFF", "TIMESTAMPS"]}, 400, "Expect only one trace level 'OFF' is specified"),
        (None, {"trace_rate": "fast"}, 400, "Unable to parse 'trace_rate', got: fast"),
        (None, {"trace_count": "-2"}, 400, "Expecting value >= -1"),
        (None, {"trace_rate": "0"}, 400, "Attempting to set invalid trace setting :sample rate must be non-zero"),
        ("no_such_model", {}, 400, "Request for unknown model : no_such_model"),
    ]:
        with pytest.raises(InferenceServerException) as e:
            settings(kind, traced, model, update)
        assert str(e.value.status()) == status[code], (update, e.value)
        assert words in e.value.message(), e.value.message()
    # Nothing changed.
    assert settings(kind, traced)["trace_rate"] == "1"


def test_the_routes_answer_as_tritons(traced):
    base = traced.base
    # Triton serves no per-version trace setting.
    assert requests.get(base + "/v2/models/classifier/versions/1/trace/setting", timeout=10).status_code == 404
    r = requests.put(base + "/v2/trace/setting", timeout=10)
    assert r.status_code == 405 and set(r.headers["Allow"].split(", ")) == {"GET", "POST"}
    # A value of the wrong JSON type says so (Triton answers these with a 500).
    r = requests.post(base + "/v2/trace/setting", json={"trace_rate": 5}, timeout=10)
    assert r.status_code == 400 and "'trace_rate' must be a string" in r.json()["error"]
    # An empty body changes nothing.
    assert requests.post(base + "/v2/trace/setting", timeout=10).json()["trace_rate"] == "1"


def test_restricted_trace_api_needs_its_key(tmp_path):
    s = Server("--http-restricted-api=trace:key=secret", "--grpc-restricted-protocol=trace:key=secret")
    try:
        assert requests.get(s.base + "/v2/trace/setting", timeout=10).status_code == 403
        r = requests.get(s.base + "/v2/trace/setting", headers={"key": "secret"}, timeout=10)
        assert r.status_code == 200 and r.json()["trace_mode"] == "triton"
        with pytest.raises(InferenceServerException) as e:
            grpcclient.InferenceServerClient(s.grpc_url).get_trace_settings()
        assert str(e.value.status()) == "StatusCode.PERMISSION_DENIED"
        got = grpcclient.InferenceServerClient(s.grpc_url).get_trace_settings(
            headers={"triton-grpc-protocol-key": "secret"}, as_json=True)
        assert got["settings"]["trace_level"]["value"] == ["OFF"]
    finally:
        s.stop()


def test_opentelemetry_settings_are_listed():
    s = Server("--trace-config=mode=opentelemetry", "--trace-config=opentelemetry,url=localhost:4318/v1/traces",
               "--trace-config=opentelemetry,resource=service.name=vg_test")
    try:
        got = requests.get(s.base + "/v2/trace/setting", timeout=10).json()
        assert got["trace_mode"] == "opentelemetry" and got["url"] == "localhost:4318/v1/traces"
        assert got["resource"] == "service.name=vg_test"
        assert (got["bsp_max_queue_size"], got["bsp_schedule_delay"], got["bsp_max_export_batch_size"]) == \
            ("2048", "5000", "512")
        assert "trace_file" not in got and "log_frequency" not in got
    finally:
        s.stop()
