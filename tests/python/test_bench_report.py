"""The bench's JSON document records the variables that change what a run
measures (a declared NVL domain size, NVSHMEM's transports), and only those."""
import os

from turnout.bench.report import record


def test_record_keeps_turnout_and_nvshmem_variables(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("TURNOUT_", "NVSHMEM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TURNOUT_NVL_DOMAIN_SIZE", "2")
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "none")
    monkeypatch.setenv("SOMETHING_ELSE", "1")
    doc = record(["python", "-m", "turnout.bench"], {"low_latency": []}, {"gpus": []})
    assert doc["environment"] == {"NVSHMEM_REMOTE_TRANSPORT": "none", "TURNOUT_NVL_DOMAIN_SIZE": "2"}
    assert doc["command"] == ["python", "-m", "turnout.bench"] and doc["results"] == {"low_latency": []}
