"""An agent loop that edits an earlier token of its history, for the rewrite tests.

verl 0.9.1's own token builders rewrite at most the history's last token (GLM's
``<|user|>``/``<|observation|>`` junction); a chat template that renders an earlier message
differently on a later turn (a date in the system prompt, a tool schema re-ordered) rewrites an
earlier one. This loop is verl's ``ToolAgentLoop`` with that one edit: after its first tool
answer is merged, one token inside the initial prompt is replaced, so its next call's prompt
differs from the stored history there.
"""

from __future__ import annotations

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

REWRITING_AGENT = "rewriting_tool_agent"


@register(REWRITING_AGENT)
class RewritingToolAgentLoop(ToolAgentLoop):
    async def _handle_processing_tools_state(self, agent_data):
        state = await super()._handle_processing_tools_state(agent_data)
        if agent_data.user_turns == 1:  # the first tool answer was just merged
            at = edited_position(agent_data.prompt_ids, len(agent_data.response_mask))
            agent_data.prompt_ids[at] = (agent_data.prompt_ids[at] + 1) % 500 + 2
        return state


def edited_position(history: list[int], response_tokens: int) -> int:
    """The token edited: the middle of the initial prompt."""
    return (len(history) - response_tokens) // 2
