"""llama.cpp's RPC backend: a model's layers on other machines, and a server for them.

A client registers each ``HOST:PORT`` with ggml's RPC registry before the model loads
(:func:`add_servers`); ``--n-gpu-layers`` then offloads layers to those devices as to a GPU, split
between several servers by their free memory. Each address is first probed here with a timeout:
nothing listening, no answer, or a server of another protocol version is one clear error rather
than a hang or ggml's abort. The patched ggml (native/patches/ggml-rpc-no-abort.patch) marks a
connection failed when its server stops answering; :func:`failures` counts them, and every
decode on an RPC model checks the count, so a dead server ends the answer with an error and
never gives a token computed from zeros.

:func:`serve` runs llama.cpp's RPC server (``ggml_backend_rpc_start_server``, what its rpc-server
program calls) in this process: ``eesd rpc-server``. The protocol has no authentication: anyone who
can reach the port can read and write the memory the server holds. It binds 127.0.0.1 unless told
otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import re
import socket
import struct
import tempfile
import threading
from pathlib import Path

from eesd_local.base.errors import EesdError
from eesd_local.llama.ggmlapi import ggml_symbol, init_backend, rpc_failures

PROTO = (7, 0)  # RPC_PROTO_MAJOR_VERSION, RPC_PROTO_MINOR_VERSION of the vendored ggml
_HELLO = 14  # RPC_CMD_HELLO
_CAPS = 24  # RPC_CONN_CAPS_SIZE: the hello's capability bytes (none offered here)
PROBE_TIMEOUT_S = 5.0
UNSAFE = ("the RPC protocol has no authentication: anyone who can reach {where} can read and write the memory "
          "this server holds and make it compute")


class RpcError(EesdError):
    """An RPC server that cannot be used, or stopped answering."""


def parse_endpoints(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` (or a list of them) -> checked ``host:port`` strings."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
    out = []
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RpcError(f"not an RPC server address: {item!r}", hint="give HOST:PORT, e.g. --rpc 127.0.0.1:50052")
        out.append(f"{host.strip('[]')}:{int(port)}")
    if not out:
        raise RpcError("no RPC server address given", hint="e.g. --rpc 127.0.0.1:50052")
    return out


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[int, int, int]:
    """Connect and say hello as ggml's client does; the server's protocol version, or RpcError."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack("<BQ", _HELLO, _CAPS) + bytes(_CAPS))
            size = struct.unpack("<Q", _recv(sock, 8))[0]
            if size != 4 + _CAPS:
                raise RpcError(f"{endpoint} is not an RPC server of llama.cpp's protocol {PROTO[0]}.x "
                               f"(its hello answer has {size} bytes)", hint="start `eesd rpc-server` there")
            major, minor, patch = struct.unpack("<BBBx", _recv(sock, 4))
            _recv(sock, _CAPS)
    except ConnectionRefusedError:
        raise RpcError(f"nothing listens at {endpoint} (connection refused)",
                       hint="start `eesd rpc-server --port PORT` on that machine first") from None
    except TimeoutError:
        raise RpcError(f"{endpoint} did not answer within {timeout:.0f} s",
                       hint="check the address and that no firewall drops the port") from None
    except OSError as exc:
        raise RpcError(f"cannot reach {endpoint}: {exc.strerror or exc}") from None
    if major != PROTO[0] or minor > PROTO[1]:
        raise RpcError(f"{endpoint} speaks RPC protocol {major}.{minor}.{patch}, this llama.cpp speaks "
                       f"{PROTO[0]}.{PROTO[1]}", hint="run an rpc-server built from the same llama.cpp there (eesd rpc-server)")
    return major, minor, patch


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise RpcError(f"the server at {sock.getpeername()[0]} closed the connection during the hello")
        data += chunk
    return data


def _fn(name: str, restype, argtypes) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = ggml_symbol(name)
    if fn is None:
        raise RpcError("this llama.cpp was built without the RPC backend",
                       hint="install with scripts/setup.sh (it builds llama-cpp-python with -DGGML_RPC=ON and the patch)")
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def failures() -> int:
    """RPC connections that failed in this process so far (0 where none was ever made)."""
    return rpc_failures()


_added: set[str] = set()
_lock = threading.Lock()


def add_servers(endpoints: list[str]) -> None:
    """Probe each server, then register it with ggml (before a model loads, so its layers can go there)."""
    init_backend()
    if ggml_symbol("ggml_backend_rpc_failures") is None:
        raise RpcError("this llama.cpp cannot survive a lost RPC server (it lacks eesd-local's patch)",
                       hint="install with scripts/setup.sh")
    add = _fn("ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    register = _fn("ggml_backend_register", None, [ctypes.c_void_p])
    with _lock:
        for ep in endpoints:
            if ep in _added:
                continue
            probe(ep)
            before = failures()
            reg = add(ep.encode())
            if not reg or failures() > before:
                raise RpcError(f"the RPC server at {ep} answered the hello but offers no device")
            register(reg)  # its devices join the ones llama.cpp offloads layers to
            _added.add(ep)


LISTEN_HINT = "pass an IPv4 address of this machine: --host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)"


def listen_address(host: str, port: int) -> str:
    """The IPv4 address ``host`` names, checked before llama.cpp's server starts: ggml's server binds
    an IPv4 address given as numbers only (it says "Failed to create server socket" for anything else),
    so a name is looked up here, and a host that names nothing, an IPv6 address, an address of another
    machine or a port in use is an RpcError that says which."""
    where = f"{host}:{port}"
    if re.fullmatch(r"[\d.]+", host):  # dotted numbers are an IPv4 address or nothing: never a name to look up
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise RpcError(f"cannot listen on {where}: {host} is not an IPv4 address", hint=LISTEN_HINT) from None
        address = host
    else:
        try:
            ipaddress.IPv6Address(host.strip("[]"))
        except ValueError:
            pass
        else:
            raise RpcError(f"cannot listen on {where}: llama.cpp's RPC server listens on IPv4 addresses only",
                           hint=LISTEN_HINT)
        try:
            address = str(socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except UnicodeError:  # an empty label ("bad..host") or one too long
            raise RpcError(f"cannot listen on {where}: {host!r} is not a valid host name", hint=LISTEN_HINT) from None
        except OSError as exc:
            raise RpcError(f"cannot listen on {where}: the host {host!r} names no IPv4 address "
                           f"({exc.strerror or exc})", hint=LISTEN_HINT) from None
    failed = _bind_error(address, port)
    if failed is not None and failed.errno == errno.EADDRINUSE:
        raise RpcError(f"cannot listen on {where}: the port is in use",
                       hint="another program listens there: stop it or pick another --port")
    if failed is not None:
        raise RpcError(f"cannot listen on {where}: {failed.strerror or failed}", hint=LISTEN_HINT)
    return address


def _bind_error(address: str, port: int) -> OSError | None:
    """What binding ``address``:``port`` as ggml binds it (SO_REUSEADDR, then bind) raises now, if anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            return exc
    return None


def port_in_use(address: str, port: int) -> bool:
    """Whether binding ``address``:``port`` now fails because another socket holds it."""
    failed = _bind_error(address, port)
    return failed is not None and failed.errno == errno.EADDRINUSE


def cache_folder(path: str | os.PathLike[str]) -> str:
    """``path`` as a folder the server can keep tensors in (made if missing), absolute; an RpcError
    where it cannot be made or written (ggml's server would fail to write each file without a word)."""
    folder = Path(path).expanduser()
    hint = "pass a folder you can write to, e.g. --cache ~/.cache/eesd-local/rpc"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RpcError(f"cannot keep the cache in {str(path)!r}: it is a file, not a folder", hint=hint) from None
    except OSError as exc:
        raise RpcError(f"cannot make the cache folder {str(path)!r}: {exc.strerror or exc}", hint=hint) from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise RpcError(f"cannot write to the cache folder {str(path)!r}: {exc.strerror or exc}", hint=hint) from None
    return str(folder.resolve())


def serve(host: str, port: int, n_threads: int, *, cache_dir: str | None = None) -> None:
    """Serve this machine's devices (its GPUs, else its CPU) to RPC clients until the process ends;
    ``host`` is an IPv4 address (:func:`listen_address`)."""
    init_backend()
    start = _fn("ggml_backend_rpc_start_server", None,
                [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)])
    count = _fn("ggml_backend_dev_count", ctypes.c_size_t, [])
    get = _fn("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t])
    kind = _fn("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p])
    devs = [get(i) for i in range(count())]
    chosen = [d for d in devs if kind(d) in (1, 2)] or [d for d in devs if kind(d) == 0]  # GPU/IGPU, else CPU
    if not chosen:
        raise RpcError("no device to serve")
    arr = (ctypes.c_void_p * len(chosen))(*chosen)
    start(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, n_threads, len(chosen), arr)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
