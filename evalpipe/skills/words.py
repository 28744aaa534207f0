"""Word lists shared by the skill generators (plain ASCII, no digits, so numbers only come from the task)."""

NAMES = [
    ("Lena", "she"), ("Omar", "he"), ("Mia", "she"), ("Theo", "he"), ("Ava", "she"), ("Ravi", "he"),
    ("Nora", "she"), ("Liam", "he"), ("Zoe", "she"), ("Ivan", "he"), ("Ella", "she"), ("Hugo", "he"),
    ("Maya", "she"), ("Owen", "he"), ("Iris", "she"), ("Felix", "he"), ("Sara", "she"), ("Jonas", "he"),
    ("Lucy", "she"), ("Marco", "he"),
]
ITEMS = [
    "apples", "stamps", "marbles", "coins", "books", "pencils", "shells", "cards", "beads", "stickers",
    "buttons", "cookies", "candles", "ribbons", "tickets", "bottles", "flowers", "rocks", "keys", "cups",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
FILLER_SENTENCES = [
    "The weather is calm and sunny.", "A small dog sleeps by the door.", "The shop on the corner is busy.",
    "Birds sing in the old oak tree.", "The kitchen smells of fresh bread.", "A cold wind blows from the hills.",
    "The river runs past the quiet town.", "Children play in the green park.", "The library closes early today.",
    "A red bus stops at the station.", "The garden gate is painted blue.", "Clouds drift over the harbor.",
    "The market sells fruit and cheese.", "A cat watches from the window.", "The bells ring in the square.",
    "Snow covers the tops of the mountains.",
]
ADJECTIVES = [
    "violet", "golden", "silent", "crimson", "frozen", "hidden", "amber", "silver", "ancient", "misty",
    "copper", "emerald", "hollow", "scarlet", "quiet", "northern", "bright", "rusty", "velvet", "stormy",
    "pale", "wild", "lunar", "distant",
]
NOUNS = [
    "harbor", "lantern", "orchard", "meadow", "tower", "river", "garden", "bridge", "forest", "castle",
    "valley", "island", "mirror", "temple", "canyon", "market", "station", "cabin", "fountain", "glacier",
    "lighthouse", "desert", "harvest", "compass",
]
NOTE_WORDS = ["river", "lantern", "granite", "orchard", "meadow", "copper", "harbor", "thistle", "violet", "summit"]
