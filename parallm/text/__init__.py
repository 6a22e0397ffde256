"""Text processing for the tokenizer and detokenizer stages: pure Python, no sockets."""

from parallm.text.detokenize import IncrementalDetokenizer
from parallm.text.sequence import DetokState
from parallm.text.stop import StopStringMatcher
from parallm.text.templating import Templater, TemplateError
from parallm.text.vocab import TokenizerView, token_string_bytes

__all__ = ["IncrementalDetokenizer", "DetokState", "StopStringMatcher", "Templater", "TemplateError",
           "TokenizerView", "token_string_bytes"]
