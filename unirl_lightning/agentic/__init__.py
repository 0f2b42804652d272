"""The agentic family: its controller (episodes of turns, each turn's version stamp, the tail policy)
and its loop (episodes through the environments' coordinator), above the environments they drive."""
