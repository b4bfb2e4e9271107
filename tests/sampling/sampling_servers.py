"""Helpers for tests that drive a real `rljax serve` subprocess on a loopback port."""

import os
import socket
import subprocess
import sys
import time

import httpx

HTTP_TIMEOUT = 60.0
STARTUP_TIMEOUT = 180.0
ADMIN_TOKEN = "test-admin-token-4f9c2e"  # reaches the server through $RLJAX_ADMIN_TOKEN, never argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.02)


class Server:
    """`python -m rljax.cli serve --config.model=tiny --config.port=N ...` (started at once, awaited by ready())."""

    def __init__(self, *flags, cache_dir=None, admin_token=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env.pop("RLJAX_ADMIN_TOKEN", None)
        if admin_token:
            env["RLJAX_ADMIN_TOKEN"] = admin_token
        if cache_dir:  # later servers load the first one's compiled programs instead of compiling
            env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rljax.cli", "serve", "--config.model=tiny", f"--config.port={self.port}",
             "--config.max_batch=8", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ready(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server on port {self.port} not ready after {STARTUP_TIMEOUT}s")

    def health(self):
        return httpx.get(self.url + "/health", timeout=HTTP_TIMEOUT).json()

    def get(self, path, **kwargs):
        return httpx.get(self.url + path, timeout=HTTP_TIMEOUT, **kwargs)

    def post(self, path, **kwargs):
        return httpx.post(self.url + path, timeout=HTTP_TIMEOUT, **kwargs)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
