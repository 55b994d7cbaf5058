"""llama.cpp's BPE pre-tokenizers: every `tokenizer.ggml.pre` name it accepts, as HF split steps.

Traced to llama.cpp 0c1e57098 (the copy vendored in llama-cpp-python 0.3.36; `:N` is a line of its
src/llama-vocab.cpp): `llama_vocab::impl::load` maps each name to a pre-tokenizer type and flags
(:2155-2428), `llm_tokenizer_bpe` gives each type its regexes (:280-575), and src/unicode.cpp
`unicode_regex_split` runs them. Each regex splits every piece the previous one left, keeping its
matches and the text between them (HF `Split(behavior="isolated")`). Our regexes are llama.cpp's,
rewritten only where llama.cpp does not run a regex the way HF's Oniguruma would:

* A regex using \\p{..} runs on a "collapsed" copy of the text where each non-ASCII character
  is replaced by one byte for its category (unicode.cpp:1247-1330): \\p{Lu}, \\p{Ll}, \\p{Lt},
  \\p{Lm} and \\p{Lo} all become \\p{L}, so we write \\p{L}.
* A regex without \\p{..} runs on code points, but non-ASCII whitespace is first replaced by \\v
  (unicode.cpp:1344-1350): a class that lists such a character never matches it, so we drop it
  (`&&\\S`), and its `$` ends the piece (`\\z`). Its \\d is ASCII only ([0-9]).
* Some regexes are only names for C++ splitters (unicode.cpp:1050-1078). GPT-2's, llama3's,
  qwen2's, qwen35's and the newline splitter match their regex; kimi-k2's and the AFMoE digit
  splitter do not, so we write what the C++ does (see KIMI_K2 and _GROUPS_OF_3).
"""

from __future__ import annotations

from dataclasses import dataclass

_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # contractions, either case
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL
# "Upper" = a letter that is not a-z, "lower" = a letter that is not A-Z (llama.cpp's spelling).
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_LEAD = r"[^\r\n\p{L}\p{N}]?"  # an optional character that is no letter, digit or newline
_CASED_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# deepseek-llm's letters (:312), as llama.cpp lists them
_DS_LETTERS = ("A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄ"
               "ῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
_DS_CJK = r"[[一-龥ࠀ-一가-퟿]&&\S]+"  # :315 and :347, less the whitespace in U+0800-U+4E00
_DS3_CJK = r"[一-龥぀-ゟ゠-ヿ]+"
_DS3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_NEWLINES = r"[^\n]+|[\n]+"
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
# unicode_cpt_is_han (unicode.cpp:1184-1214), which kimi-k2's splitter uses for \p{Han}.
_HAN = ("\u4E00-\u9FFF\u3400-\u4DBF\U00020000-\U0002A6DF\U0002A700-\U0002B73F\U0002B740-\U0002B81F"
        "\U0002B820-\U0002CEAF\U0002CEB0-\U0002EBEF\uF900-\uFAFF\U0002F800-\U0002FA1F")
# The AFMoE digit splitter (unicode.cpp:948-1021): each run of \p{N} cut into groups of three from
# the right, text before a run joined to its first group.
_GROUPS_OF_3 = (r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))", "merged_with_previous")


@dataclass(frozen=True)
class PreType:
    """One `llama_vocab_pre_type`: what `llm_tokenizer_bpe` and the BPE session do with it."""

    splits: tuple[tuple[str, str], ...]  # (regex, HF split behaviour), applied in order
    byte_encode: bool = True  # GPT-2 byte alphabet; False: raw UTF-8, <0xXX> bytes (:536, :720-732)
    force_bos: bool = False   # add_bos_token is forced on (:2650-2656)


def _iso(*regexes: str) -> tuple[tuple[str, str], ...]:
    return tuple((r, "isolated") for r in regexes)


TYPES: dict[str, PreType] = {
    # :561-569 (the `default:` case)
    "DEFAULT": PreType(_iso(r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    # :284-292; the same regex for DBRX/SMAUG :302-308 and CHATGLM4 :406-410
    "LLAMA3": PreType(_iso(_LLAMA3)),
    # :293-301
    "JAIS2": PreType(_iso(_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                          r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)"
                          r"|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)"
                          r"|\s{1}")),
    # :309-318
    "DEEPSEEK_LLM": PreType(_iso(r"[\r\n]", r"\s?[" + _DS_LETTERS + "]+",
                                 r"\s?[!-/:-~！-／：-～‘-‟、-。]+", r"\s+\z", _DS_CJK, r"\p{N}+")),
    # :319-328; also HUNYUAN_DENSE, JOYAI_LLM, HY_V4
    "DEEPSEEK3_LLM": PreType(_iso(r"\p{N}{1,3}", _DS3_CJK, _DS3)),
    # :329-336
    "SPARK2_5": PreType(_iso(r"\p{N}{1,3}", _DS3_CJK,
                             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                             r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]"
                             r"|\s+(?!\S)|\s+", r"\p{N}")),
    # :337-342
    "YOUTU": PreType(_iso(r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
                          _LEAD + r"[\p{L}\p{M}]+" + _C + r"?|\p{N}" + _CASED_TAIL)),
    # :343-351
    "DEEPSEEK_CODER": PreType(_iso(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DS_CJK, r"\p{N}")),
    # :352-358
    "FALCON": PreType(_iso(r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    # :359-371; also REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2
    "STARCODER": PreType(_iso(r"\p{N}", _GPT2)),
    # :372-381; also MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING
    "GPT2": PreType(_iso(_GPT2)),
    # :382-391; also STABLELM2, HUNYUAN, SOLAR_OPEN, and GROK_2 :497-503
    "QWEN2": PreType(_iso(_QWEN2)),
    # :392-398
    "QWEN35": PreType(_iso(_C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
                           r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")),
    # :399-405; also PORO, GPT3_FINNISH
    "BLOOM": PreType(_iso(_BLOOM)),
    # :411-416
    "VIKING": PreType(_iso(_BLOOM, r"\p{N}")),
    # :417-423
    "TEKKEN": PreType(_iso(_LEAD + _UPPER + "*" + _LOWER + "+|" + _LEAD + _UPPER + "+" + _LOWER
                           + r"*|\p{N}" + _CASED_TAIL)),
    # :424-437
    "CHAMELEON": PreType(_iso(r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                              r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2)),
    # :438-445; also MINIMAX_M2
    "GPT4O": PreType(_iso(_LEAD + _UPPER + "*" + _LOWER + "+" + _C + "?|" + _LEAD + _UPPER + "+"
                          + _LOWER + "*" + _C + r"?|\p{N}{1,3}" + _CASED_TAIL)),
    # :446-454
    "GRANITE_EMB_MULTI": PreType(_iso(
        _LEAD + r"((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _C + "?|"
        + _LEAD + r"((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _C
        + r"?|\p{N}{1,3}" + _CASED_TAIL)),
    # :455-462; its digit regex is a name for the AFMoE digit splitter (unicode.cpp:1069-1075)
    "TINY_AYA": PreType((_GROUPS_OF_3,
                         *_iso(_LEAD + r"[\p{L}\p{M}]+" + _C + r"?|\p{N}{1,3}" + _CASED_TAIL))),
    # :463-469, kimi-k2's splitter (unicode.cpp:777-946): Han runs, words of non-Han letters
    "KIMI_K2": PreType(_iso(f"[{_HAN}]+|{_LEAD}" + r"[\p{L}&&[^" + _HAN + "]]+" + _C
                            + r"?|\p{N}{1,3}" + _TAIL)),
    # :470-475
    "SUPERBPE": PreType(_iso(r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))")),
    # :476-483
    "BAILINGMOE": PreType(_iso(r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])"
                               r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                               r"|\s*[\r\n]|\s+(?!\S)|\s+")),
    # :484-490
    "SEED_CODER": PreType(_iso(_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                               r"|\s*[\r\n]+|\s+(?!\S)|\s+")),
    # :491-496
    "UFAKZEKA": PreType(_iso(r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL)),
    # :504-514
    "AFMOE": PreType((_GROUPS_OF_3, *_iso(
        r"[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+", _DS3))),
    # :515-520
    "LAGUNA": PreType(_iso(_NEWLINES, _QWEN2)),
    # :521-527
    "EXAONE_MOE": PreType(_iso(_C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                               r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")),
    # :528-537. llama.cpp also emits a run of newlines that is a token whole, without merges
    # (:637-643); Gemma 4's merges build every such token anyway, so plain BPE gives the same ids.
    "GEMMA4": PreType(_iso(_NEWLINES), byte_encode=False, force_bos=True),
    # :538-545
    "SARVAM_MOE": PreType(_iso(_NEWLINES), byte_encode=False),
    # :546-553
    "MINICPM5": PreType(_iso(r"\p{N}{1,3}", _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+" + _TAIL)),
    # :554-560
    "WHITESPACE": PreType(_iso(r"\S+"), byte_encode=False),
}


@dataclass(frozen=True)
class PreRules:
    """What a `tokenizer.ggml.pre` name means to llama.cpp (`llama_vocab::impl::load`)."""

    type: str                    # key into TYPES (llama.cpp's LLAMA_VOCAB_PRE_TYPE_<type>)
    ignore_merges: bool = False  # a whole pre-token found in the vocab is emitted as is
    add_bos: bool = False        # default of add_bos_token before the file's key
    clean_spaces: bool = True    # detokenizer's clean_up_tokenization_spaces (BPE default, :2158)
    no_bos: bool = False         # the family has no BOS token unless the file names one
    escape_whitespaces: bool = False  # spaces become U+2581 before tokenizing (SPM-style BPE)


def _all(names: str, rules: PreRules) -> dict[str, PreRules]:
    return dict.fromkeys(names.split(), rules)


_GPT2_RULES = PreRules("GPT2")
_QWEN2_RULES = PreRules("QWEN2", clean_spaces=False)
PRE_RULES: dict[str, PreRules] = {
    "default": PreRules("DEFAULT"),  # :2166-2169
    "minicpm5": PreRules("MINICPM5", ignore_merges=True),  # :2170-2172
    **_all("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
           PreRules("LLAMA3", ignore_merges=True, add_bos=True)),  # :2173-2185
    "deepseek-llm": PreRules("DEEPSEEK_LLM", clean_spaces=False),  # :2186-2189
    "deepseek-coder": PreRules("DEEPSEEK_CODER", clean_spaces=False),  # :2190-2193
    "deepseek-v3": PreRules("DEEPSEEK3_LLM", clean_spaces=False),  # :2194-2197
    "spark2_5": PreRules("SPARK2_5", clean_spaces=False),  # :2198-2201
    "youtu": PreRules("YOUTU", clean_spaces=False, ignore_merges=True),  # :2202-2206
    "falcon": PreRules("FALCON"),  # :2207-2209
    "mpt": _GPT2_RULES,  # :2210-2212
    "starcoder": PreRules("STARCODER"),  # :2213-2215
    **_all("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert",
           _GPT2_RULES),  # :2216-2227
    "jais-2": PreRules("JAIS2"),  # :2228-2230
    **_all("gemma4 granite-embed-multi-311m",
           PreRules("GEMMA4", escape_whitespaces=True)),  # :2231-2235
    "sarvam-moe": PreRules("SARVAM_MOE", escape_whitespaces=True, clean_spaces=False),  # :2236-2240
    # :2241-2246; their add_sep does not reach llama_tokenize
    **_all("jina-v1-en jina-v2-code roberta-bpe", _GPT2_RULES),
    # :2247-2250; its lowercase flag only acts in the "whitespace" tokenizer model, refused here
    "whitespace": PreRules("WHITESPACE"),
    "refact": PreRules("STARCODER"),  # :2251-2253
    "command-r": PreRules("STARCODER", clean_spaces=False),  # :2254-2257
    **_all("qwen2 deepseek-r1-qwen kormo f2llmv2", _QWEN2_RULES),  # :2258-2264
    "qwen35": PreRules("QWEN35", clean_spaces=False),  # :2265-2268
    "stablelm2": PreRules("QWEN2"),  # :2269-2271
    "olmo": _GPT2_RULES,  # :2272-2274
    **_all("dbrx smaug-bpe", PreRules("LLAMA3")),  # :2275-2280
    "poro-chat": PreRules("BLOOM", clean_spaces=False),  # :2281-2284
    # :2285-2288 (CHATGLM4: llama3's regex)
    "chatglm-bpe": PreRules("LLAMA3", no_bos=True),
    **_all("glm4 glm5", PreRules("LLAMA3", ignore_merges=True, no_bos=True)),  # :2289-2294
    "viking": PreRules("VIKING", clean_spaces=False),  # :2295-2298
    "jais": _GPT2_RULES,  # :2299-2301
    # :2302-2307
    "tekken": PreRules("TEKKEN", clean_spaces=False, ignore_merges=True, add_bos=True),
    "smollm": PreRules("STARCODER", clean_spaces=False),  # :2308-2311
    "codeshell": PreRules("STARCODER"),  # :2312-2314
    **_all("bloom gpt3-finnish", PreRules("BLOOM")),  # :2315-2320
    "exaone": PreRules("STARCODER"),  # :2321-2323
    "exaone4": _GPT2_RULES,  # :2324-2326
    "exaone-moe": PreRules("EXAONE_MOE"),  # :2327-2329
    "chameleon": PreRules("CHAMELEON", add_bos=True, clean_spaces=False),  # :2330-2334
    "minerva-7b": PreRules("STARCODER"),  # :2335-2337
    "megrez": PreRules("QWEN2"),  # :2338-2340
    **_all("gpt-4o llama4 kanana2 talkie", PreRules("GPT4O", clean_spaces=False)),  # :2341-2347
    "granite-embed-multi-97m": PreRules("GRANITE_EMB_MULTI", clean_spaces=False,
                                        ignore_merges=True),  # :2348-2352
    **_all("tiny_aya cohere2moe", PreRules("TINY_AYA", clean_spaces=False)),  # :2353-2357
    "superbpe": PreRules("SUPERBPE", clean_spaces=False),  # :2358-2361
    "trillion": PreRules("GPT2", clean_spaces=False),  # :2362-2365
    "granite-docling": PreRules("GPT2", clean_spaces=False),  # :2366-2369
    # :2370-2375
    **_all("bailingmoe bailingmoe2 llada-moe", PreRules("BAILINGMOE", clean_spaces=False)),
    "seed-coder": PreRules("SEED_CODER", clean_spaces=False),  # :2376-2379
    "hunyuan": _QWEN2_RULES,  # :2380-2383
    # :2384-2395
    **_all("hunyuan-dense hy_v4 joyai-llm", PreRules("DEEPSEEK3_LLM", clean_spaces=False)),
    "kimi-k2": PreRules("KIMI_K2", clean_spaces=False),  # :2396-2399
    "ufakzeka": PreRules("UFAKZEKA", clean_spaces=False),  # :2400-2403
    "grok-2": _QWEN2_RULES,  # :2404-2407
    "afmoe": PreRules("AFMOE", clean_spaces=False),  # :2408-2411
    "laguna": PreRules("LAGUNA", clean_spaces=False),  # :2412-2415
    "minimax-m2": PreRules("GPT4O", clean_spaces=False),  # :2416-2419
    "solar-open": _QWEN2_RULES,  # :2420-2423
    "mellum2": PreRules("STARCODER"),  # :2424-2426
}
