"""The test checkpoints' tokenizer: a real byte-level BPE (Qwen2's pre-tokenizer) trained on a small built-in
corpus, with Qwen's special and added tokens and a Qwen-style chat template, so that ids differ from Qwen's
but every code path (special tokens, chat template, decoding) is the real one."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

BPE_VOCAB_SIZE = 1400

# Qwen's special tokens, in Qwen's order, appended after the BPE vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added but not special: they survive `decode(skip_special_tokens=True)`, as in Qwen's tokenizer.
PLAIN_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A Qwen-style chat template: string or list content; image/image_url and video/video_url parts become
# vision placeholders; tools and tool calls are rendered the way Qwen3-VL-Instruct renders them.
CHAT_TEMPLATE = r"""{%- set media = namespace(images=0, videos=0) -%}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type in ['image', 'image_url'] or 'image' in part or 'image_url' in part -%}
                {%- set media.images = media.images + 1 -%}
                {%- if add_vision_id -%}{{- 'Picture ' ~ media.images ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ['video', 'video_url'] or 'video' in part or 'video_url' in part -%}
                {%- set media.videos = media.videos + 1 -%}
                {%- if add_vision_id -%}{{- 'Video ' ~ media.videos ~ ': ' -}}{%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif not (loop.first and tools and message.role == 'system') -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) -}}
        {%- if message.role == 'assistant' and message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
                {%- set fn = call.function if call.function else call -%}
                {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
                {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) -}}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Training text for the BPE: plain English about pictures, videos and everyday things.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and a video is worth
many pictures. Describe this image in detail. What is shown in the picture? There is a cat sitting on a
red chair next to the window. The sun is shining and the sky is blue with a few white clouds.
A small boy is playing with a yellow ball in the garden, while his sister reads a book under a tall tree.
In the video, a man walks along the beach at sunset. Waves roll onto the sand and birds fly over the water.
The camera slowly moves to the left and shows a lighthouse on the rocks. Then the scene changes to a busy
street in the city, full of cars, buses, bicycles and people walking to work in the morning.
Please answer the question. How many apples are on the table? There are three green apples and two red
apples on the wooden table. The kitchen is bright and clean. A kettle is boiling on the stove.
Can you read the text on the sign? The sign says: "Welcome to the museum. Open every day from 9 to 5."
This chart shows the number of visitors in each month of the year. The highest value is in July and the
lowest value is in February. The line goes up in spring and comes down again in autumn.
I think the answer is yes, because the dog is looking at the ball and its tail is moving. It is happy.
The photo was taken at night. The lights of the houses are reflected in the river, and the moon is full.
You are a helpful assistant. You should answer the user's questions carefully and explain your reasoning.
Hello! How can I help you today? Thank you very much. You're welcome. Let's look at the image together.
First, we find the object; second, we measure its size; finally, we compare it with the others.
The mountain is covered with snow, and the forest below it is dark green. A river runs through the valley.
A woman in a blue dress is holding an umbrella because it is raining. People are waiting for the train.
The train arrives at the station at 10:45 and leaves again after five minutes. It's going to be late!
Numbers: 0 1 2 3 4 5 6 7 8 9 10 20 100 1000 2024 3.14 42 7% $19.99 #1 (a) [b] {c} <d> a+b=c x*y/z
Code: def main(): print("hello, world") return 0 if x > 1 else -1; for i in range(10): total += i
The model looks at every frame of the video and writes a short caption for each scene that it sees.
Colors: red, orange, yellow, green, blue, indigo, violet, black, white, gray, brown, pink, purple, gold.
Animals: cat, dog, horse, cow, sheep, bird, fish, lion, tiger, bear, rabbit, mouse, elephant, monkey.
Objects: table, chair, window, door, car, bus, phone, computer, lamp, bottle, cup, plate, knife, bag.
They were talking about the weather, the news, and the football match that they watched last weekend.
She said that she would come back tomorrow, but nobody knew whether she really meant it or not.
We have been working on this problem for a long time, and now we finally understand what went wrong.
The important thing is not to stop asking questions. Curiosity has its own reason for existing.
On the left side of the image there is a tall building; on the right side there is a small park.
At the top of the page there is a title in large letters, and below it there are two columns of text.
The person in the center of the picture is smiling and wearing glasses, a hat, and a green jacket.
Is there anything unusual in this scene? Yes: the clock on the wall shows the wrong time, and the
shadow of the tree points in a different direction from the shadows of the people.
Summarize the video in one sentence. A chef prepares a meal, tastes it, and serves it to the guests.
Translate to French: good morning, thank you, please, goodbye. Bonjour, merci, s'il vous plaît, au revoir.
Some words with accents: café, naïve, résumé, jalapeño, Zürich, São Paulo, Ångström, façade, coöperate.
What happens next? The door opens and a dog runs into the room, jumping over the sleeping cat.
Every morning the baker opens the shop at six o'clock and sells fresh bread, cakes and cookies.
The children built a sand castle with towers, walls and a bridge, and then the sea washed it away.
Write a list of the main steps:
1. Open the box.
2. Take out the parts.
3. Read the instructions carefully.
4. Put the parts together.
The weather today is cold and windy, with some rain in the afternoon and clear skies in the evening.
Where was this picture taken? It looks like a market in a small town, with fruit and vegetables on
display, colorful flowers, and people carrying baskets. Someone is buying oranges from an old man.
The robot picks up the red block and places it on top of the blue block, then it moves back.
Between the two trees there is a wooden bench where an old couple is sitting and feeding the pigeons.
"""


def train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on `CORPUS` and append Qwen's special and added tokens."""
    tokenizer = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, max_positions: int) -> dict:
    """`tokenizer_config.json` in the form Qwen3-VL ships it."""
    decoder = {
        str(token_id): {
            "content": added.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": added.special,
        }
        for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_positions,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
