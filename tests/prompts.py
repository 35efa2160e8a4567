"""Prompts shared by the engine and model tests."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, my friend.",
    "The three primary colors are",
    "Q: What is the boiling point of water?\nA:",
    "Les élèves étudient l'histoire et la géographie parce que",
]
