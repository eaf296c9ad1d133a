"""A LangGraph graph recorded two ways into one run: the SDK's checkpointer (`ActaeCheckpointSaver`, its
`channel_resolver` naming the channel by the thread id, which is `--run`) stores every checkpoint as a
state snapshot, and LangChain's OpenInference instrumentation exports the graph's spans over OTLP with
`actae.channel_id` = `--run` (the same graph as langgraph_run.py: an agent node calling a fake chat
model, a tool node). Prints the graph's answer as JSON."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _otlp import Exporting, arguments  # noqa: E402

from langgraph_run import weather_graph  # noqa: E402  (the same graph as langgraph_run.py)
from openinference.instrumentation.langchain import LangChainInstrumentor  # noqa: E402

from actae_client import ActaeClient  # noqa: E402
from actae_client.adapters.langgraph import ActaeCheckpointSaver  # noqa: E402


def main() -> None:
    args = arguments()
    exporting = Exporting(args, "langgraph-adapter-test")
    LangChainInstrumentor().instrument(tracer_provider=exporting.provider)
    saver = ActaeCheckpointSaver(ActaeClient(endpoint=args.url, api_key=args.key),
                                 channel_resolver=lambda config: config["configurable"]["thread_id"])
    graph = weather_graph().compile(checkpointer=saver)
    out = graph.invoke({"messages": [("user", "Weather in Paris?")]}, {"configurable": {"thread_id": args.run}})
    exporting.finish()
    print(json.dumps({"final": out["messages"][-1].content}))


if __name__ == "__main__":
    main()
