"""Error types that reach the user as one line, without a traceback."""


class AiperfError(Exception):
    """Base of every error caused by user input (bad graph, bad file, bad option)."""


class GraphError(AiperfError, ValueError):
    """A graph, its JSON form or its weights are malformed. The message names the node."""

    def __init__(self, message: str, node: str | None = None):
        self.node = node
        super().__init__(f"node '{node}': {message}" if node is not None else message)
