"""A minimal Hugging Face Hub on 127.0.0.1 for publishing tests: the endpoints huggingface_hub's
create_repo / upload_folder / paths-info / whoami use, storing every committed file on disk, with
fault injection. Written from huggingface_hub 1.33's client code (hf_api.py, _commit_api.py, lfs.py);
the LFS path is the one the client takes with HF_HUB_DISABLE_XET=1.
"""

import base64
import hashlib
import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

TOKEN = "fake-hub-token-for-tests"  # not shaped like a real token


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self, root: Path):
        self.root = root
        self.repos: dict[str, dict] = {}  # repo_id -> {"sha": str, "files": {path: sha256}}
        self.requests: list[tuple[str, str]] = []
        self.faults: dict[str, list[int]] = {}  # path substring -> statuses to answer first
        self.lock = threading.Lock()
        (root / "lfs").mkdir(parents=True, exist_ok=True)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()

    def file(self, repo_id: str, path: str) -> bytes:
        """The bytes of `path` at the head of the repo's main branch."""
        return (self.root / "lfs" / self.repos[repo_id]["files"][path]).read_bytes()

    def add_repo(self, repo_id: str, files: dict[str, bytes]):
        with self.lock:
            self.repos[repo_id] = {"sha": uuid.uuid4().hex + "00000000", "files": {}}
            for path, data in files.items():
                self.repos[repo_id]["files"][path] = self._store(data)

    def _store(self, data: bytes) -> str:
        oid = hashlib.sha256(data).hexdigest()
        (self.root / "lfs" / oid).write_bytes(data)
        return oid

    def _handler(hub):  # noqa: N805 - the handler closes over the hub
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def send(self, code, obj=None, headers=None, raw=None, head=False):
                data = raw if raw is not None else json.dumps(obj).encode() if obj is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def error(self, code, message, error_code=None):
                headers = {"X-Error-Message": message}
                if error_code:
                    headers["X-Error-Code"] = error_code
                self.send(code, {"error": message}, headers)

            def handle_any(self, method):
                url = urlsplit(self.path)
                path, query = url.path, parse_qs(url.query)
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                with hub.lock:
                    hub.requests.append((method, path))
                    for key, codes in hub.faults.items():
                        if key in path and codes:
                            return self.error(codes.pop(0), f"injected fault on {key}")
                if path.startswith("/lfs-upload/"):
                    oid = path.rsplit("/", 1)[1]
                    if hashlib.sha256(body).hexdigest() != oid:
                        return self.error(400, "sha256 mismatch")
                    hub._store(body)
                    return self.send(200, raw=b"")
                if self.headers.get("authorization") != f"Bearer {TOKEN}":
                    return self.error(401, "Invalid credentials in Authorization header")
                if path == "/api/whoami-v2":
                    return self.send(200, {"type": "user", "name": "tester", "orgs": []})
                if path == "/api/validate-yaml":
                    return self.send(200, {"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    d = json.loads(body)
                    repo_id = f"{d.get('organization') or 'tester'}/{d['name']}"
                    if repo_id in hub.repos:
                        return self.send(409, {"error": "already exists", "url": f"{hub.url}/{repo_id}"})
                    hub.add_repo(repo_id, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
                    return self.send(200, {"url": f"{hub.url}/{repo_id}"})
                m = re.fullmatch(r"/([^/]+/[^/]+)\.git/info/lfs/objects/batch", path)
                if m:
                    objects = []
                    for o in json.loads(body)["objects"]:
                        entry = {"oid": o["oid"], "size": o["size"]}
                        if not (hub.root / "lfs" / o["oid"]).exists():
                            entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}
                        objects.append(entry)
                    return self.send(200, {"transfer": "basic", "objects": objects})
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if m and method in ("GET", "HEAD"):  # hf_hub_download: the file at the head of main
                    repo = hub.repos.get(m[1])
                    if repo is None:
                        return self.error(404, "Repository not found", "RepoNotFound")
                    if m[3] not in repo["files"]:
                        return self.error(404, "Entry not found", "EntryNotFound")
                    data = (hub.root / "lfs" / repo["files"][m[3]]).read_bytes()
                    return self.send(200, raw=data, head=method == "HEAD",
                                     headers={"X-Repo-Commit": repo["sha"], "ETag": f'"{git_sha1(data)}"'})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(/.*)?", path)
                if m:
                    repo = hub.repos.get(m[1])
                    if repo is None:
                        return self.error(404, "Repository not found", "RepoNotFound")
                    return self.repo_api(method, m[1], repo, m[2] or "", query, body)
                return self.error(404, f"unhandled {method} {path}")

            def entries(self, repo, paths):
                out = []
                for p in paths:
                    if p in repo["files"]:
                        data = (hub.root / "lfs" / repo["files"][p]).read_bytes()
                        e = {"type": "file", "path": p, "size": len(data), "oid": git_sha1(data)}
                        if p.endswith(".safetensors"):
                            e["lfs"] = {"oid": repo["files"][p], "size": len(data), "pointerSize": 134}
                        out.append(e)
                return out

            def repo_api(self, method, repo_id, repo, rest, query, body):
                if method == "GET" and (rest == "" or rest.startswith("/revision/")):
                    return self.send(200, {"id": repo_id, "sha": repo["sha"], "private": False,
                                           "siblings": [{"rfilename": p} for p in sorted(repo["files"])]})
                if method == "GET" and rest.startswith("/tree/"):
                    return self.send(200, self.entries(repo, sorted(repo["files"])))
                if method == "POST" and rest.startswith("/paths-info/"):
                    return self.send(200, self.entries(repo, parse_qs(body.decode()).get("paths", [])))
                if method == "POST" and rest.startswith("/preupload/"):
                    files = []
                    for f in json.loads(body)["files"]:
                        lfs = f["path"].endswith(".safetensors")
                        oid = None
                        if f["path"] in repo["files"]:
                            data = (hub.root / "lfs" / repo["files"][f["path"]]).read_bytes()
                            oid = repo["files"][f["path"]] if lfs else git_sha1(data)
                        files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                                      "shouldIgnore": False, "oid": oid})
                    return self.send(200, {"files": files})
                if method == "POST" and rest.startswith("/commit/"):
                    files = dict(repo["files"])
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            files[item["value"]["path"]] = hub._store(base64.b64decode(item["value"]["content"]))
                        elif item["key"] == "deletedFile":
                            files.pop(item["value"]["path"], None)
                        elif item["key"] == "lfsFile":
                            if not (hub.root / "lfs" / item["value"]["oid"]).exists():
                                return self.error(422, "LFS object missing")
                            files[item["value"]["path"]] = item["value"]["oid"]
                    sha = uuid.uuid4().hex + "00000000"
                    pr_url = None
                    with hub.lock:
                        if query.get("create_pr") == ["1"]:
                            n = sum(1 for k in hub.repos if k.startswith(repo_id + "@pr")) + 1
                            hub.repos[f"{repo_id}@pr{n}"] = {"sha": sha, "files": files}
                            pr_url = f"{hub.url}/{repo_id}/discussions/{n}"
                        else:
                            repo["sha"], repo["files"] = sha, files
                    return self.send(200, {"commitOid": sha, "commitUrl": f"{hub.url}/{repo_id}/commit/{sha}",
                                           "pullRequestUrl": pr_url})
                return self.error(404, f"unhandled {method} {rest}")

            def do_GET(self):
                self.handle_any("GET")

            def do_HEAD(self):
                self.handle_any("HEAD")

            def do_POST(self):
                self.handle_any("POST")

            def do_PUT(self):
                self.handle_any("PUT")

        return Handler
