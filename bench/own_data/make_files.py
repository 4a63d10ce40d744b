"""Made-up own-data tasks for the tiny path (issue 42), each with its own checker.

    python bench/own_data/make_files.py OUT_DIR     # writes cheerful_en.jsonl (200 rows), formal_zh.jsonl (600),
                                                    # travel_mixed.jsonl (2,000)

cheerful_en: a shop assistant's answers; the chosen one is cheerful and ends with "!", the rejected one is the
same fact said flatly ("."). Checker `is_cheerful` (this file): English words that end with "!".
formal_zh: a front desk's answers in Chinese; the chosen one is formal (您, 请, ends with "。"), the rejected one
casual (你, ends with "啦"). Checker `is_formal` (this file).
travel_mixed: a travel desk asked in English or in Chinese (half each); the chosen answer is in the question's
language, the rejected one gives the same fact in the other language. Checker `same_language` (this file): the reply
is in the prompt's language, clean, and ends with "." or "。".
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

ITEMS = ["apples", "bread", "milk", "rice", "coffee", "tea", "eggs", "cheese", "soap", "batteries", "candles",
         "towels", "pasta", "honey", "butter", "lamps", "socks", "gloves", "umbrellas", "notebooks", "pencils",
         "plates", "cups", "spoons", "flowers", "seeds", "paint", "brushes", "glue", "scissors", "maps", "kites",
         "games", "puzzles", "shoes", "hats", "scarves", "jam", "juice", "cookies"]
QUESTIONS = ["Where can I find the {item}?", "Do you sell {item}?", "How much are the {item}?",
             "Are the {item} fresh today?", "Can I return the {item} I bought?"]
FACTS = ["The {item} are in aisle {n}", "Yes, we sell {item} in aisle {n}", "The {item} cost {n} dollars",
         "The {item} came in this morning", "You can return the {item} within {n} days"]
CHEER = ["Happy to help", "Great question", "Sure thing", "Good news", "Of course"]
FLAT = ["Okay", "Well", "Fine", "Right", "Yes"]
_WORD = re.compile(r"[A-Za-z]+|\d+")


def is_cheerful(response: str) -> bool:
    """The checker: a reply of at least three words, made of English words and numbers (no stray bytes), that ends
    with "!"."""
    text = response.strip()
    words = text.split()
    clean = sum(1 for w in words if _WORD.fullmatch(w.strip(".,!?'")))
    return text.endswith("!") and len(words) >= 3 and clean >= 0.9 * len(words)


def cheerful_rows(n: int = 200, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(i, q) for i in range(len(ITEMS)) for q in range(len(QUESTIONS))]
    rng.shuffle(pairs)
    rows = []
    for i, q in pairs[:n]:
        item, num = ITEMS[i], rng.randint(2, 30)
        fact = FACTS[q].format(item=item, n=num)
        rows.append({"question": QUESTIONS[q].format(item=item),
                     "chosen": f"{rng.choice(CHEER)}! {fact}!",
                     "rejected": f"{rng.choice(FLAT)}. {fact}."})
    return rows


PLACES = ["前台", "餐厅", "健身房", "泳池", "停车场", "会议室", "洗衣房", "商店", "花园", "图书室", "电梯", "大堂",
          "早餐厅", "咖啡厅", "酒吧", "医务室", "行李房", "书店", "银行", "药店"]
ASKS = ["{p}在哪里？", "{p}几点开门？", "{p}可以预约吗？", "{p}要收费吗？", "{p}今天开放吗？", "{p}离这里远吗？"]
ZH_FACTS = ["{p}在{n}楼", "{p}早上{n}点开门", "{p}可以提前{n}天预约", "{p}每次收费{n}元", "{p}今天开放到{n}点",
            "{p}走路大约{n}分钟"]
FORMAL = ["您好，", "感谢您的提问，", "请您放心，", "您好，很高兴为您服务，"]
CASUAL = ["嗯，", "哦，", "好吧，", "那个，"]


def is_formal(response: str) -> bool:
    """The checker: a polite formal reply: says 您, never 你 alone, and ends with "。"."""
    text = response.strip()
    return "您" in text and "你" not in text.replace("您", "") and text.endswith("。")


def formal_rows(n: int = 600, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        p, q = PLACES[k % len(PLACES)], (k // len(PLACES)) % len(ASKS)
        num = rng.randint(2, 20)
        fact = ZH_FACTS[q].format(p=p, n=num)
        rows.append({"question": ASKS[q].format(p=p), "chosen": f"{rng.choice(FORMAL)}{fact}，请您留意。",
                     "rejected": f"{rng.choice(CASUAL)}{fact}，你自己看着办啦"})
    return rows


CITIES = [("Beijing", "北京"), ("Shanghai", "上海"), ("Guangzhou", "广州"), ("Shenzhen", "深圳"), ("Chengdu", "成都"),
          ("Hangzhou", "杭州"), ("Xian", "西安"), ("Wuhan", "武汉"), ("Nanjing", "南京"), ("Tianjin", "天津"),
          ("Suzhou", "苏州"), ("Qingdao", "青岛"), ("Xiamen", "厦门"), ("Dalian", "大连"), ("Kunming", "昆明"),
          ("Harbin", "哈尔滨"), ("Lhasa", "拉萨"), ("Guilin", "桂林"), ("Sanya", "三亚"), ("Tokyo", "东京"),
          ("London", "伦敦"), ("Paris", "巴黎"), ("Sydney", "悉尼"), ("Toronto", "多伦多"), ("Berlin", "柏林")]
# (English question, Chinese question, English fact, Chinese fact); {c}: the city, {n}: a number
TRAVEL = [("When does the train to {c} leave?", "去{c}的火车几点出发？",
           "The train to {c} leaves at {n} in the morning.", "去{c}的火车{n}点出发。"),
          ("How warm is {c} tomorrow?", "明天{c}多少度？", "It will be {n} degrees in {c} tomorrow.", "明天{c}气温{n}度。"),
          ("How long is the flight to {c}?", "飞{c}要多久？", "The flight to {c} takes {n} hours.", "飞{c}大约要{n}个小时。"),
          ("How much is a hotel in {c}?", "{c}的酒店多少钱？", "A hotel in {c} costs about {n}0 dollars a night.",
           "{c}的酒店每晚大约{n}0元。"),
          ("How many days should I stay in {c}?", "在{c}玩几天合适？", "Most people stay in {c} for {n} days.",
           "在{c}一般玩{n}天。"),
          ("Is {c} busy this week?", "{c}这周人多吗？", "{c} has about {n} big events this week.",
           "{c}这周大约有{n}个大活动。"),
          ("Which gate is the bus to {c}?", "去{c}的大巴在几号门？", "The bus to {c} leaves from gate {n}.",
           "去{c}的大巴在{n}号门。"),
          ("How far is the airport in {c}?", "{c}的机场远吗？", "The airport in {c} is {n} kilometres away.",
           "{c}的机场离市区{n}公里。")]
EN_OPEN = ["Sure.", "Good question.", "Let me check.", "Here you go."]
ZH_OPEN = ["好的，", "我帮您查一下，", "没问题，", "您好，"]
_CJK = re.compile(r"[\u4e00-\u9fff]")
_LATIN = re.compile(r"[A-Za-z]")


def same_language(response: str, prompt: str) -> bool:
    """The checker: the reply is in the question's language (a question with any Chinese character is Chinese):
    Chinese, at least four Chinese characters, no Latin letter, ending with "。"; English, at least three words of
    English letters and numbers (no stray bytes), no Chinese character, ending with "."."""
    text = response.strip()
    # the rendered prompt's chat template is ASCII, so a Chinese character in it is the question's
    if _CJK.search(prompt):
        return len(_CJK.findall(text)) >= 4 and not _LATIN.search(text) and text.endswith("。")
    words = text.split()
    clean = sum(1 for w in words if _WORD.fullmatch(w.strip(".,!?'")))
    return (not _CJK.search(text) and text.endswith(".") and len(words) >= 3
            and clean >= 0.9 * len(words))


def travel_rows(n: int = 2000, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        (en_city, zh_city), (q_en, q_zh, f_en, f_zh) = rng.choice(CITIES), rng.choice(TRAVEL)
        num = rng.randint(2, 12)
        en = f"{rng.choice(EN_OPEN)} {f_en.format(c=en_city, n=num)}"
        zh = f"{rng.choice(ZH_OPEN)}{f_zh.format(c=zh_city, n=num)}"
        if rng.random() < 0.5:
            rows.append({"question": q_en.format(c=en_city), "chosen": en, "rejected": zh})
        else:
            rows.append({"question": q_zh.format(c=zh_city), "chosen": zh, "rejected": en})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "cheerful_en.jsonl", cheerful_rows())
    write_jsonl(out / "formal_zh.jsonl", formal_rows())
    write_jsonl(out / "travel_mixed.jsonl", travel_rows())
    print(out / "cheerful_en.jsonl", out / "formal_zh.jsonl", out / "travel_mixed.jsonl")
