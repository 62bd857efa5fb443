"""The fixed chat prompts of the batching benchmarks (SmolLM2 on the CPU): 24 short requests, a third of
them asking to repeat or transform given text, where a prompt-lookup drafter finds its tokens."""

PROMPTS = [
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Add a docstring to this function and return the full code:\n\ndef area(width, height):\n    return width * height\n",
    "Summarize in two sentences: The Moon is Earth's only natural satellite. It orbits Earth every 27.3 days "
    "and its gravity causes the tides. The Moon has no atmosphere and its surface is covered in craters.",
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: Good morning. How are you today? I am fine, thank you.",
    "Copy this sentence twice: The quick brown fox jumps over the lazy dog.",
    "List the days of the week in order.",
    "Rewrite in the past tense: I walk to the store, I buy some bread, and I go home.",
    "Name three primary colors.",
    "Fix the typo and repeat the sentence: The cat sat on the matt and looked at the door.",
    "Write a haiku about the ocean.",
    "Convert this list to a numbered list: red, orange, yellow, green, blue, indigo, violet.",
    "Explain in one sentence what a CPU does.",
    "Return this JSON with the key 'age' set to 31: {\"name\": \"Ada\", \"age\": 30, \"city\": \"London\"}",
    "What is 12 times 12?",
    "Spell the word 'necessary' letter by letter.",
    "Give two synonyms for 'happy'.",
    "Repeat after me: to be or not to be, that is the question.",
    "Write a short greeting for a birthday card.",
    "Sort these numbers from smallest to largest: 42, 7, 19, 3, 88, 25.",
    "What does HTML stand for?",
    "Write the alphabet from A to J separated by commas.",
    "Describe a sunset in one sentence.",
]
