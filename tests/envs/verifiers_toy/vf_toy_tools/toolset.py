"""The `add` tool of vf_toy_tools, an MCP server verifiers starts per rollout (`python -m` this module)."""

import verifiers.v1 as vf


class AddTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None   # the model calls `add`, not `add_tools_add`

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(int(a) + int(b))


if __name__ == "__main__":
    AddTools.run()
