"""Tool calls, format-neutral: the model formats (parsers.py and the format modules it registers:
deepseek.py, harmony.py, pythonic.py) and what a conversation's `tools` / `tool_choice` mean for
the prompt and the answer (support.py). Shared by the server and LLM.chat; imports neither."""
