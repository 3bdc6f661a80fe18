"""The agent-loop tests' tool, loaded by verl from ``multi_turn.function_tool_path``."""

from verl.tools.function_tool import function_tool


@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)
