"""How a job comes in: its body parsed and checked (the field rules, the JSON parser, tool calls,
structured-output constraints compiled) and its prompt rendered as the engine will see it."""
