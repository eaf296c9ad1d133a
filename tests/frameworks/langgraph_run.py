"""A LangGraph graph, offline: an agent node calling a fake chat model (a tool call, then the answer)
and a tool node, instrumented through LangChain's OpenInference instrumentation, its spans exported to
Actae. Prints the graph's answer as JSON."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _otlp import Exporting, arguments  # noqa: E402

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel  # noqa: E402
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.graph import START, MessagesState, StateGraph  # noqa: E402
from langgraph.prebuilt import ToolNode, tools_condition  # noqa: E402
from openinference.instrumentation.langchain import LangChainInstrumentor  # noqa: E402


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"21 degrees in {city}"


def weather_graph() -> StateGraph:
    """The graph both LangGraph drivers run: an agent node calling a fake chat model (a tool call, then
    the answer) and a tool node, not yet compiled."""
    model = GenericFakeChatModel(messages=iter([
        AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}],
                  usage_metadata={"input_tokens": 40, "output_tokens": 9, "total_tokens": 49}),
        AIMessage(content="It is 21 degrees in Paris.",
                  usage_metadata={"input_tokens": 60, "output_tokens": 8, "total_tokens": 68}),
    ]))

    def agent(state: MessagesState):
        return {"messages": [model.invoke(state["messages"])]}
    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph


def main() -> None:
    args = arguments()
    exporting = Exporting(args, "langgraph-test")
    LangChainInstrumentor().instrument(tracer_provider=exporting.provider)
    out = weather_graph().compile().invoke({"messages": [("user", "Weather in Paris?")]})
    exporting.finish()
    print(json.dumps({"final": out["messages"][-1].content}))


if __name__ == "__main__":
    main()
