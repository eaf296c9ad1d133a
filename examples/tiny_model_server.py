"""A tiny deterministic model server: OpenAI's chat completions and responses, Anthropic's messages,
streamed and not, on loopback, with no network and no model. For the gateway's demo and tests.

    python examples/tiny_model_server.py --port 8011

It answers every request with "echo: " and the last user message, counts tokens as words, and
takes its faults from the model name: `fail-500` (a 500 in the provider's shape), `garbage` (a 200
that is not JSON), `slow-SECONDS` (waits before answering), `drip` (a stream of 40 events, 0.1 s
apart). GET /stats says how many calls it took, and how many streams a client broke off.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def words(text: str) -> int:
    return len(text.split())


def message_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def conversation(body: dict) -> tuple:
    """(every message's text, the last user message's text)."""
    if "messages" in body:
        texts = [message_text(m.get("content")) for m in body["messages"] if isinstance(m, dict)]
        users = [message_text(m.get("content")) for m in body["messages"] if isinstance(m, dict) and m.get("role") == "user"]
        system = body.get("system") if isinstance(body.get("system"), str) else ""
        return [system, *texts], users[-1] if users else ""
    given = body.get("input")
    if isinstance(given, str):
        return [given], given
    texts = [message_text(m.get("content")) for m in given or [] if isinstance(m, dict)]
    return texts, texts[-1] if texts else ""


class Stats:
    def __init__(self):
        self.lock, self.calls, self.aborted = threading.Lock(), 0, 0
        self.last_key = None        # the key the last call came with (what a gateway sent as the upstream's)

    def count(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True      # a head and a body written apart must not wait for an ACK
    stats: Stats

    def log_message(self, *args) -> None:
        pass

    def send_json(self, status: int, document: object) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/stats":
            self.send_json(200, {"calls": self.stats.calls, "aborted": self.stats.aborted})
        else:
            self.send_json(404, {"error": {"message": "not found", "type": "not_found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        self.stats.count("calls")
        self.stats.last_key = self.headers.get("authorization") or self.headers.get("x-api-key")
        model = str(body.get("model", "tiny"))
        if model.startswith("slow-"):
            time.sleep(float(model[5:]))
        if model == "fail-500":
            return self.send_json(500, {"error": {"message": "the tiny model failed", "type": "server_error"}})
        if model == "garbage":
            data = b"<html>not a model</html>"
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        texts, last = conversation(body)
        answer = "echo: " + last
        usage = (sum(words(t) for t in texts), words(answer))
        api = {"/v1/chat/completions": chat, "/v1/responses": responses, "/v1/messages": messages}.get(self.path)
        if api is None:
            return self.send_json(404, {"error": {"message": f"no {self.path}", "type": "not_found"}})
        if body.get("stream") is True:
            return self.stream(api(model, answer, usage, body, streamed=True), drip=model == "drip")
        self.send_json(200, api(model, answer, usage, body, streamed=False))

    def stream(self, events: list, drip: bool) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        if drip:
            events = events[:1] + [events[1]] * 40 + events[2:]
        try:
            for event in events:
                self.wfile.write(event.encode())
                self.wfile.flush()
                if drip:
                    time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            self.stats.count("aborted")
        self.close_connection = True


def sse(data: object, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return head + "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"


def chat(model: str, answer: str, usage: tuple, body: dict, streamed: bool):
    call_id, created = "chatcmpl-" + uuid.uuid5(uuid.NAMESPACE_URL, answer).hex[:12], 1_700_000_000
    counts = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    if not streamed:
        return {"id": call_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                             "finish_reason": "stop"}], "usage": counts}
    base = {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model}
    events = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    events += [sse({**base, "choices": [{"index": 0, "delta": {"content": piece + " "}}]}) for piece in answer.split()]
    events.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(sse({**base, "choices": [], "usage": counts}))
    return events + [sse("[DONE]")]


def responses(model: str, answer: str, usage: tuple, body: dict, streamed: bool):
    response_id = "resp_" + uuid.uuid5(uuid.NAMESPACE_URL, answer).hex[:12]
    counts = {"input_tokens": usage[0], "output_tokens": usage[1], "total_tokens": sum(usage),
              "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": answer, "annotations": []}]}
    done = {"id": response_id, "object": "response", "created_at": 1_700_000_000, "model": model,
            "status": "completed", "output": [item], "usage": counts, "tools": [], "tool_choice": "auto",
            "parallel_tool_calls": True}
    if not streamed:
        return done
    started = {**done, "status": "in_progress", "output": [], "usage": None}
    events = [sse({"type": "response.created", "response": started, "sequence_number": 0}, "response.created")]
    events += [sse({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0,
                    "delta": piece + " ", "sequence_number": n}, "response.output_text.delta")
               for n, piece in enumerate(answer.split(), start=1)]
    return events + [sse({"type": "response.completed", "response": done, "sequence_number": len(events)},
                         "response.completed")]


def messages(model: str, answer: str, usage: tuple, body: dict, streamed: bool):
    message_id = "msg_" + uuid.uuid5(uuid.NAMESPACE_URL, answer).hex[:12]
    whole = {"id": message_id, "type": "message", "role": "assistant", "model": model,
             "content": [{"type": "text", "text": answer}], "stop_reason": "end_turn", "stop_sequence": None,
             "usage": {"input_tokens": usage[0], "output_tokens": usage[1]}}
    if not streamed:
        return whole
    start = {**whole, "content": [], "stop_reason": None, "usage": {"input_tokens": usage[0], "output_tokens": 1}}
    events = [sse({"type": "message_start", "message": start}, "message_start"),
              sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  "content_block_start")]
    events += [sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece + " "}},
                   "content_block_delta") for piece in answer.split()]
    return events + [sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                     sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"output_tokens": usage[1]}}, "message_delta"),
                     sse({"type": "message_stop"}, "message_stop")]


def serve(port: int = 0) -> tuple:
    """(the server, its Stats): serving on a thread of its own until `server.shutdown()`."""
    stats = Stats()
    handler = type("TinyHandler", (Handler,), {"stats": stats})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, stats


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8011)
    server, _ = serve(parser.parse_args().port)
    print(f"tiny model server on http://127.0.0.1:{server.server_address[1]} (Ctrl-C to stop)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
