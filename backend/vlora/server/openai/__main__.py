"""``python -m vlora.server.openai``: the OpenAI-compatible front end's process (``vlora serve`` starts it)."""
import sys

from vlora.server.openai import main

sys.exit(main())
