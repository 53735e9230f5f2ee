"""The fixed texts ``genserve-bench quant-accuracy`` measures with: greedy prompts on varied
subjects (raw continuations and chat-formatted questions in the embedded model's format) and
a public-domain passage for perplexity."""

from __future__ import annotations

_CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

# Fixed prompts: raw continuations and chat-formatted questions on varied subjects.
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\n",
    "The history of the Roman Empire begins",
    "Photosynthesis is the process by which plants",
    "1, 2, 3, 5, 8, 13, 21,",
    "Dear Sir or Madam,\n\nI am writing to",
    _CHAT.format("What is 17 times 23?"),
    _CHAT.format("Write a haiku about the sea."),
    _CHAT.format("Give me three tips for learning a new language."),
    _CHAT.format("Explain what a hash table is in two sentences."),
    _CHAT.format("Translate 'good morning' into Spanish and German."),
    _CHAT.format("List the planets of the solar system in order from the sun."),
)

# Jane Austen, Pride and Prejudice (1813), the opening of chapter 1; public domain.
PASSAGE = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, \
must be in want of a wife.

However little known the feelings or views of such a man may be on his first entering a \
neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he \
is considered the rightful property of some one or other of their daughters.

"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is \
let at last?"

Mr. Bennet replied that he had not.

"But it is," returned she; "for Mrs. Long has just been here, and she told me all about it."

Mr. Bennet made no answer.

"Do you not want to know who has taken it?" cried his wife impatiently.

"You want to tell me, and I have no objection to hearing it."

This was invitation enough.

"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of \
large fortune from the north of England; that he came down on Monday in a chaise and four to \
see the place, and was so much delighted with it, that he agreed with Mr. Morris immediately; \
that he is to take possession before Michaelmas, and some of his servants are to be in the \
house by the end of next week."

"What is his name?"

"Bingley."

"Is he married or single?"

"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. \
What a fine thing for our girls!"

"How so? How can it affect them?"

"My dear Mr. Bennet," replied his wife, "how can you be so tiresome! You must know that I am \
thinking of his marrying one of them."

"Is that his design in settling here?"

"Design! Nonsense, how can you talk so! But it is very likely that he may fall in love with \
one of them, and therefore you must visit him as soon as he comes."

"I see no occasion for that. You and the girls may go, or you may send them by themselves, \
which perhaps will be still better, for as you are as handsome as any of them, Mr. Bingley \
may like you the best of the party."

"My dear, you flatter me. I certainly have had my share of beauty, but I do not pretend to \
be anything extraordinary now. When a woman has five grown-up daughters, she ought to give \
over thinking of her own beauty."
"""
