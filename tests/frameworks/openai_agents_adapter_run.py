"""The OpenAI Agents SDK through the SDK's own adapter, offline: `install_actae_tracing` records every span
the Agents SDK ends into the channel `--run`, and a snapshot of each finished trace (OpenAI's own trace
export is switched off first: offline). Two runs of an agent with one tool, its model
OpenAIChatCompletionsModel pointed at the scripted chat-completions server of fake_openai.py; then the
adapter's `fork_trace` forks the channel at the first run's snapshot into `--run`-fork.

With `--gateway BASE`: one run of a tool-less agent whose model is OpenAIResponsesModel (the Agents SDK's
default model class) on an OpenAI client whose base URL is BASE (the Actae model gateway's run URL).

Prints, as JSON: the answers, and the trace ids in the order the runs were made."""
import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai import serve  # noqa: E402

from agents import (Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,  # noqa: E402
                    set_trace_processors, trace)
from agents.tracing import gen_trace_id  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from actae_client import ActaeClient  # noqa: E402
from actae_client.adapters.openai_agents import install_actae_tracing  # noqa: E402


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"21 degrees in {city}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--gateway")
    args = p.parse_args()

    set_trace_processors([])                    # no export to OpenAI's own tracing: offline
    client = ActaeClient(endpoint=args.url, api_key=args.key)
    processor = install_actae_tracing(client, channel=args.run)
    if args.gateway:
        model = OpenAIResponsesModel(model="gpt-4o-mini",
                                     openai_client=AsyncOpenAI(base_url=args.gateway, api_key=args.key))
        agents = [Agent(name="Echo", instructions="Repeat the question.", model=model)]
        questions = ["hello agents"]
    else:
        server, _ = serve()
        chat = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="offline")
        model = OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=chat)
        agents = [Agent(name="Weather", instructions="Answer with the weather.", tools=[get_weather], model=model)] * 2
        questions = ["Weather in Paris?", "Weather in Paris?"]

    answers, trace_ids = [], []
    for agent, question in zip(agents, questions):
        trace_ids.append(gen_trace_id())
        with trace("weather", trace_id=trace_ids[-1]):
            answers.append(asyncio.run(Runner.run(agent, question)).final_output)
    processor.force_flush()                     # the adapter writes from its own thread: wait for it

    forked = None
    if not args.gateway:
        forked = f"{args.run}-fork"

        async def fork_first():
            try:
                await processor.fork_trace(trace_ids[0], forked)
            finally:
                await client.disconnect()
        asyncio.run(fork_first())
    processor.shutdown()
    print(json.dumps({"answers": answers, "trace_ids": trace_ids, "fork": forked}))


if __name__ == "__main__":
    main()
