"""The OpenAI Agents SDK, offline: an agent with one tool, its model OpenAIChatCompletionsModel pointed at
a scripted chat-completions server on loopback (a tool call, then the answer), instrumented with
OpenInference's instrumentation, its spans exported to Actae. Prints the agent's answer as JSON."""
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _otlp import Exporting, arguments  # noqa: E402
from fake_openai import serve  # noqa: E402

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_trace_processors  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor  # noqa: E402


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"21 degrees in {city}"


def main() -> None:
    args = arguments()
    exporting = Exporting(args, "openai-agents-test")
    set_trace_processors([])                    # no export to OpenAI's own tracing: offline
    OpenAIAgentsInstrumentor().instrument(tracer_provider=exporting.provider)
    server, _ = serve()
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="offline")
    agent = Agent(name="Weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=client))
    result = asyncio.run(Runner.run(agent, "Weather in Paris?"))
    exporting.finish()
    print(json.dumps({"final": result.final_output}))


if __name__ == "__main__":
    main()
