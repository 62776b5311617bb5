"""The packed token layer: tokenizers, chat-template rendering with exact loss masks (issue 15)."""
