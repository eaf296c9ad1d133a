"""A scripted OpenAI chat-completions server on loopback: the first call with tools asks for get_weather
(one tool call), any later one answers. Each answer reports its usage, as the real API does."""
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}


def answer_to(body: dict, number: int) -> dict:
    """The `number`th call's answer: a tool call while the conversation has no tool result yet."""
    answered = any(m.get("role") == "tool" for m in body.get("messages", [])) or not body.get("tools")
    message = ({"role": "assistant", "content": "It is 21 degrees in Paris."} if answered
               else {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]})
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "gpt-4o-mini"),
            "choices": [{"index": 0, "message": message, "finish_reason": "stop" if answered else "tool_calls"}],
            "usage": {"prompt_tokens": 50 + 10 * number, "completion_tokens": 12, "total_tokens": 62 + 10 * number}}


def serve():
    """(the server, the list of request bodies it took), on a free loopback port, in a thread."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            calls.append(body)
            data = json.dumps(answer_to(body, len(calls))).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, calls
