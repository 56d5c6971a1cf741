"""A local stand-in for the W&B API server (api.wandb.ai), for tests that run W&B's public API client against runs
that this project really logged (tests cannot reach wandb.ai).

It serves runs read from offline run folders (`WANDB_MODE=offline` writes wandb/offline-run-*/run-*.wandb): their
id, name, tags, config, exit state and every history row as the run logged it. It answers the GraphQL operations
that `wandb.Api()` (wandb 0.31, through its wandb-core sidecar) sends to list runs and read their history, which is
what openrlbenchmark's `rlops_multi_metrics --scan-history` does:
    Viewer             the login check of wandb.Api(), and GetDefaultEntity
    Runs / Run         a project's runs matching a Mongo-style filter ($and, $or, $in, equality on dotted fields such
                       as config.<key>.value, tags, username), config as W&B stores it ({key: {"value": v}})
    RunHistoryKeys     the last step, where a history scan stops
    HistoryPage        history rows between two steps (each row a JSON object, as W&B's `history` field gives it)
    RunParquetHistory  no parquet export: the client then reads history pages
Any other operation is answered with a GraphQL error naming it, so a client that asks for more fails loudly.
"""

import base64
import glob
import http.server
import json
import re
import struct
import threading
import zlib

from wandb.proto import wandb_internal_pb2

BLOCK = 32768  # the .wandb file: LevelDB-log blocks of records (7-byte header: crc32, length, type)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str) -> list:
    """The protobuf Records of a run-*.wandb file (wandb 0.31 has no Python reader of its own; this one checks the
    file's magic and every chunk's checksum)."""
    data = open(path, "rb").read()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), f"{path} is not a W&B run file"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding at the end of the file
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"{path}: bad checksum at byte {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (FULL, LAST):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def item_key(item) -> str:
    return item.key or ".".join(item.nested_key)


def read_offline_run(run_folder: str) -> dict:
    """A run as the stand-in serves it, from the offline run under run_folder (the folder that holds wandb/)."""
    (path,) = glob.glob(f"{run_folder}/**/offline-run-*/run-*.wandb", recursive=True)
    run = {"config": {}, "history": [], "summary": {}, "state": "running"}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(
                id=r.run_id,
                name=r.display_name,
                project=r.project,
                entity=r.entity,
                tags=list(r.tags),
                created=r.start_time.ToJsonString(),
            )
            run["config"].update({item_key(u): json.loads(u.value_json) for u in r.config.update})
        elif kind == "config":
            run["config"].update({item_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":  # values kept as the run's JSON text (NaN stays NaN)
            run["history"].append({item_key(i): i.value_json for i in record.history.item})
        elif kind == "summary":
            run["summary"].update({item_key(u): json.loads(u.value_json) for u in record.summary.update})
        elif kind == "exit":
            run["state"] = "finished" if record.exit.exit_code == 0 else "failed"
    return run


def field(doc, dotted: str):
    for part in dotted.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def matches(doc: dict, query: dict) -> bool:
    """A Mongo-style filter, as W&B's `filters` argument takes it."""
    for key, want in query.items():
        if key == "$and":
            ok = all(matches(doc, q) for q in want)
        elif key == "$or":
            ok = any(matches(doc, q) for q in want)
        else:
            have = field(doc, key)
            values = have if isinstance(have, list) else [have]  # a list field (tags) matches if any element does
            if isinstance(want, dict) and "$in" in want:
                ok = any(v in want["$in"] for v in values)
            else:
                ok = want in values
        if not ok:
            return False
    return True


def stored_config(run: dict) -> dict:
    """The config as W&B stores it: {key: {"value": v}}."""
    return {k: {"value": v} for k, v in run["config"].items()}


def row_json(row: dict) -> str:
    """A history row as W&B's `history` field gives it: a JSON object (the values as the run wrote them)."""
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in row.items()) + "}"


class WandbApiStandin:
    """Serves `runs` (dicts from read_offline_run, with the entity and project to serve them under) on 127.0.0.1 at
    self.url; a context manager. self.requests: the GraphQL requests the clients sent, in order."""

    def __init__(self, runs: list[dict]):
        self.runs, self.requests = runs, []
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.rstrip("/") == "/graphql":
                    reply = json.dumps(standin.answer(json.loads(body)))
                else:  # the client's telemetry (/sdk/otel/...): taken and dropped
                    reply = "{}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply.encode())))
                self.end_headers()
                self.wfile.write(reply.encode())

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def node(self, run: dict) -> dict:
        """A run as W&B's GraphQL Run type gives it (every field the public API's fragments ask for). An offline run
        has no user: its entity stands in for one."""
        steps = [json.loads(row["_step"]) for row in run["history"] if "_step" in row]
        return {
            "id": base64.b64encode(f"Run:v1:{run['id']}:{run['project']}:{run['entity']}".encode()).decode(),
            "projectId": "1",
            "name": run["id"],
            "displayName": run["name"],
            "tags": run["tags"],
            "state": run["state"],
            "config": json.dumps(stored_config(run)),
            "summaryMetrics": json.dumps(run["summary"]),
            "systemMetrics": "{}",
            "historyLineCount": len(run["history"]),
            "historyKeys": {"lastStep": max(steps, default=-1), "keys": {}},
            "user": {"name": run["entity"], "username": run["entity"]},
            "createdAt": run["created"],
            "heartbeatAt": run["created"],
            "sweepName": None,
            "group": None,
            "jobType": None,
            "commit": None,
            "readOnly": False,
            "description": None,
            "notes": None,
        }

    def find(self, variables: dict) -> list[dict]:
        """The runs of the project the variables name that match their filters."""
        query = json.loads(variables.get("filters") or "{}")
        name = variables.get("name") or variables.get("runName") or variables.get("run")  # each query its own word
        if name:
            query = {"$and": [query, {"name": name}]}
        project = (variables["entity"], variables["project"])
        return [
            run
            for run in self.runs
            if (run["entity"], run["project"]) == project
            and matches(
                {"config": stored_config(run), "tags": run["tags"], "username": run["entity"], "name": run["id"]}, query
            )
        ]

    def answer(self, request: dict) -> dict:
        """The reply to one GraphQL request, by its operation's name (wandb-core does not always send operationName:
        then the name in the query's text). A run's fields: those the query names."""
        self.requests.append(request)
        text, variables = request.get("query", ""), request.get("variables") or {}
        asked = lambda node: {k: v for k, v in node.items() if re.search(rf"\b{k}\b", text)}  # noqa: E731
        named = re.search(r"\b(?:query|mutation)\s+(\w+)", text)
        operation = request.get("operationName") or (named and named[1])
        if operation in ("Viewer", "GetDefaultEntity"):
            return {
                "data": {
                    "viewer": {
                        "id": "VXNlcjox",
                        "entity": "local",
                        "username": "local",
                        "email": "",
                        "flags": "{}",
                        "teams": {"edges": []},
                    }
                }
            }
        if operation == "Runs":
            found = self.find(variables)
            edges = [{"node": asked(self.node(run)), "cursor": run["id"]} for run in found]
            page = {"endCursor": edges[-1]["cursor"] if edges else None, "hasNextPage": False}
            return {
                "data": {
                    "project": {
                        "internalId": "1",
                        "runCount": len(found),
                        "readOnly": False,
                        "runs": {"edges": edges, "pageInfo": page},
                    }
                }
            }
        if operation in ("Run", "RunHistoryKeys", "RunState", "HistoryPage", "RunParquetHistory"):
            found = self.find(variables)
            if not found:
                return {"data": {"project": {"run": None}}}
            run = found[0]
            node = self.node(run)
            if operation == "HistoryPage":
                low, high = variables.get("minStep", 0), variables.get("maxStep", 1 << 62)
                rows = [row_json(row) for row in run["history"] if low <= json.loads(row["_step"]) < high]
                node["history"] = rows[: variables.get("pageSize")]
            if operation == "RunParquetHistory":
                node["parquetHistory"] = {"liveData": [], "parquetUrls": []}
            return {"data": {"project": {"run": asked(node)}}}
        return {"errors": [{"message": f"the W&B stand-in does not answer {operation}"}], "data": None}
