"""Generation on tk's Transformer stacks: greedy search, beam search and sampling, KV-cached or
recomputing the prefix (``search``), the searches' shared state (``decoding``) and beam search's
bookkeeping (``beam``). ``from tk.core.nn.generation import generate, GenerationConfig`` is the
public way in."""

from tk.core.nn.generation.decoding import GenerationConfig, GenerationOutput, sample_next
from tk.core.nn.generation.search import beam_search, generate, greedy_decode, sample

__all__ = ["GenerationConfig", "GenerationOutput", "generate", "greedy_decode", "beam_search", "sample",
           "sample_next"]
