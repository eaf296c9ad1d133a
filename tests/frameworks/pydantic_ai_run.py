"""Pydantic AI, offline: an agent with one tool and a FunctionModel (a tool call, then the answer), with
its own OpenTelemetry instrumentation (the GenAI conventions), exported to Actae. Prints the answer."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _otlp import Exporting, arguments  # noqa: E402

from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart  # noqa: E402
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402
from pydantic_ai.models.instrumented import InstrumentationSettings  # noqa: E402


def script(messages, info: AgentInfo) -> ModelResponse:
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart("get_weather", {"city": "Paris"}, tool_call_id="c1")])
    return ModelResponse(parts=[TextPart("It is 21 degrees in Paris.")])


def main() -> None:
    args = arguments()
    exporting = Exporting(args, "pydantic-ai-test")
    Agent.instrument_all(InstrumentationSettings(tracer_provider=exporting.provider))
    agent = Agent(FunctionModel(script, model_name="gpt-4o-mini"))

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"21 degrees in {city}"
    output = agent.run_sync("Weather in Paris?").output
    exporting.finish()
    print(json.dumps({"final": output}))


if __name__ == "__main__":
    main()
