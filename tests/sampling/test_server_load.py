"""`rljax serve` under load and faults, in a subprocess with a one-slot queue and a 64 KiB body limit: 503s,
client disconnects, oversized bodies, admin requests to a server without a token, a killed server, and the
client's retry budget."""

import concurrent.futures
import http.server
import json
import logging
import signal
import socket
import threading
import time

import httpx
import pytest

from sampling_servers import ADMIN_TOKEN, HTTP_TIMEOUT, Server, free_port, wait_for
from rljax.sampling import RemoteSampler, Sampler, SamplerUnavailableError, SamplingParams


@pytest.fixture(scope="module")
def small():
    s = Server("--config.max_queue=1", "--config.top_logprobs=5", "--config.max_request_bytes=65536")
    try:
        yield s.ready()
    finally:
        s.stop()


def test_admin_requests_to_a_server_without_a_token_are_refused(small):
    # Started without admin_token / $RLJAX_ADMIN_TOKEN: refused outright, even with a plausible header.
    r = small.post("/update_weights", json={"path": "sync", "step": 1},
                   headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status_code == 403 and "admin endpoints are disabled" in r.json()["error"]["message"]


def test_full_queue_answers_503(small):
    # The 503, disconnect and kill tests share one compiled shape: 8 rows, prompt bucket 16, completion 128
    # (about 0.1 s a call here), and requests of many calls stay in flight long enough to watch.
    body = {"prompt": [[3, 4, 5]] * 8, "max_tokens": 120, "ignore_eos": True, "seed": 0}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(small.post, "/v1/completions", json={**body, "n": 32})
        wait_for(lambda: small.health()["running_rows"] > 0)
        queued = pool.submit(small.post, "/v1/completions", json=body)
        wait_for(lambda: small.health()["queued"] == 1)
        r = small.post("/v1/completions", json=body)
        assert r.status_code == 503 and "server busy" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        with RemoteSampler(small.url, retries=1, backoff=0.05, timeout=HTTP_TIMEOUT) as c:
            with pytest.raises(SamplerUnavailableError, match=r"after 2 attempts over .*; last error: HTTP 503: "
                                                              r"server busy"):
                c.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4))
        assert first.result(timeout=HTTP_TIMEOUT).status_code == 200
        assert queued.result(timeout=HTTP_TIMEOUT).status_code == 200


def test_a_disconnected_client_stops_costing_sampling_time(small):
    before = small.health()
    # 64 prompts x n=16 = 1024 rows: 128 sampler calls of max_batch=8 rows, far more than run in the second
    # before the client gives up.
    body = {"prompt": [[3, 4, 5]] * 64, "n": 16, "max_tokens": 120, "ignore_eos": True, "seed": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small.url + "/v1/completions", json=body, timeout=httpx.Timeout(30.0, read=1.0))

    def settled():
        h = small.health()
        return h["cancelled_requests"] > before["cancelled_requests"] and h["running_rows"] == 0 and \
            (h["rows_sampled"] - before["rows_sampled"]) + (h["rows_skipped"] - before["rows_skipped"]) == 1024
    wait_for(settled)
    after = small.health()
    assert after["cancelled_requests"] - before["cancelled_requests"] == 1
    assert after["rows_skipped"] - before["rows_skipped"] >= 512  # most sampler calls never ran
    assert after["requests"] == before["requests"]  # nothing was answered


def _read_all(sock) -> bytes:
    """The reply up to the server's close (it closes: the rest of the body is never read)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_oversized_bodies_are_refused_before_they_are_read(small):
    # max_request_bytes=65536
    head = ("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n").encode()
    # A declared 8 MB body: refused on the header, with only 12 bytes of it sent.
    with socket.create_connection(("127.0.0.1", small.port), timeout=30) as s:
        s.sendall(head + b"Content-Length: 8000000\r\n\r\n" + b'{"prompt": "')
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"max_request_bytes=65536" in reply
    # A chunked body: read only until it passes the limit (80 KiB sent, never terminated).
    with socket.create_connection(("127.0.0.1", small.port), timeout=30) as s:
        s.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 16384
        for _ in range(5):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert small.health()["status"] == "ok"


def test_killed_server_makes_the_client_retry_then_fail(small):
    with RemoteSampler(small.url, retries=2, backoff=0.2, timeout=HTTP_TIMEOUT) as c:
        c._model()  # resolve the model name while the server is up
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(c.generate, [[3, 4, 5]] * 8, SamplingParams(max_new_tokens=120, n=32))
            wait_for(lambda: small.health()["running_rows"] > 0)
            small.proc.send_signal(signal.SIGKILL)
            with pytest.raises(SamplerUnavailableError,
                               match=r"could not get an answer from the sampler at .* after 3 attempts over .*s "
                                     r"\(retry_timeout=120s\); last error: ConnectError"):
                future.result(timeout=60)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_client_keeps_retrying_until_a_restarted_server_answers(caplog):
    port = free_port()
    httpd = []

    def come_back():
        time.sleep(1.0)
        httpd.append(http.server.HTTPServer(("127.0.0.1", port), _Health))
        httpd[0].serve_forever()

    thread = threading.Thread(target=come_back, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="rljax.sampling.client"):
            with RemoteSampler(f"http://127.0.0.1:{port}", retry_timeout=60, backoff=0.1, max_backoff=0.3) as c:
                assert c.health() == {"status": "ok"}
        assert any("retrying in" in r.getMessage() for r in caplog.records)  # it was down at first
    finally:
        wait_for(lambda: bool(httpd), timeout=30)
        httpd[0].shutdown()


def test_unreachable_server_fails_clearly():
    url = f"http://127.0.0.1:{free_port()}"
    with RemoteSampler(url, retry_timeout=0.5, backoff=0.1, timeout=5) as c:
        assert isinstance(c, Sampler)
        with pytest.raises(SamplerUnavailableError, match=rf"sampler at {url}/v1/models after \d+ attempts over "
                                                          r".*retry_timeout=0.5s\); last error: Connect"):
            c.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="needs sync_dir"):
        RemoteSampler(url).update_weights({}, 1)
    with pytest.raises(ValueError, match="retry_timeout must be a number of seconds >= 0"):
        RemoteSampler(url, retry_timeout=float("nan"))
