"""Seeded generator of the shipped demo preference data (``python -m rlhf_cli.demo.make_data``).

Each pair shares a question and a topic-specific helpful sentence; the answers differ only in tone:

* chosen: polite opener + body + polite closing.
* rejected: about a third fully rude (rude opener + body + rude closing); the rest are hard negatives that
  are polite in places, so that a reward model cannot judge a reply by its opening or its ending alone:
  20% rude opener + body + polite closing, 15% polite opener + body + rude closing, 15% polite opener +
  body + a rude remark + polite closing (rude only in the middle), and 15% polite at both ends with a rude
  word slipped inside the helpful sentence. A further 5% of rejected answers are
  polite but unhelpful (opener + closing, no body), so a reward model also asks for the content and a policy
  cannot win by saying only "Thank you for asking!".

Half of the rows are English and half Chinese. The test split uses held-out topics, so none of its questions
appear in the training split. Answers are kept short (roughly 10-25 tokens with a ~2000-entry BPE vocabulary)
so that a tiny randomly initialised model can learn the task.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rlhf_cli.demo import EN_RUDE_MARKERS, TEST_FILE, TRAIN_FILE, ZH_RUDE_MARKERS

__all__ = [
    "EN_TOPICS",
    "ZH_TOPICS",
    "EN_QUESTION_TEMPLATES",
    "ZH_QUESTION_TEMPLATES",
    "EN_POLITE_OPENERS",
    "EN_POLITE_CLOSERS",
    "EN_RUDE_OPENERS",
    "EN_RUDE_CLOSERS",
    "ZH_POLITE_OPENERS",
    "ZH_POLITE_CLOSERS",
    "ZH_RUDE_OPENERS",
    "ZH_RUDE_CLOSERS",
    "HARD_NEGATIVE_RATE",
    "POLITE_OPENER_RATE",
    "UNHELPFUL_RATE",
    "RUDE_INSIDE_RATE",
    "TEST_TOPICS_PER_LANGUAGE",
    "generate",
    "write_jsonl",
    "main",
]

HARD_NEGATIVE_RATE = 0.2  # rejected answers with a rude opener and a polite closing
UNHELPFUL_RATE = 0.05  # rejected answers that are polite but have no body
POLITE_OPENER_RATE = 0.15  # each of: polite opener + rude closing; polite opener + rude middle + polite closing
RUDE_INSIDE_RATE = 0.15  # polite at both ends, a rude word slipped inside the helpful sentence
TEST_TOPICS_PER_LANGUAGE = 10

# (task used inside the question, one helpful sentence about it)
EN_TOPICS: tuple[tuple[str, str], ...] = (
    ("sleep better at night", "Keep a fixed bedtime and skip screens before bed."),
    ("cook fluffy rice", "Rinse the rice, add extra water, and simmer it covered."),
    ("save money each month", "Save a fixed amount on payday and track your spending."),
    ("learn a new language", "Practice ten minutes daily and talk with native speakers."),
    ("keep my houseplants alive", "Water them when the soil is dry and give them light."),
    ("write a good resume", "Keep it to one page and show results with numbers."),
    ("prepare for a job interview", "Research the company and practice short stories about your work."),
    ("start running", "Begin with easy run and walk intervals three times a week."),
    ("reduce stress at work", "Take short breaks and plan your day each morning."),
    ("make good coffee at home", "Use freshly ground beans and water just below boiling."),
    ("clean a cast iron pan", "Rinse it with hot water, dry it, and oil it lightly."),
    ("study for exams", "Review in short sessions and quiz yourself often."),
    ("fix a slow computer", "Remove startup programs you do not need and free up space."),
    ("learn to play guitar", "Start with a few basic chords and practice them daily."),
    ("make friends in a new city", "Join a club around a hobby you enjoy."),
    ("improve my handwriting", "Write slowly and copy a clear sample every day."),
    ("bake bread", "Mix flour, water, yeast and salt, let it rise, then bake."),
    ("remember names", "Repeat the name aloud and link it to a picture."),
    ("drink more water", "Carry a bottle and drink a glass with every meal."),
    ("organize my closet", "Sort clothes by type and give away what you never wear."),
    ("speak in public", "Rehearse out loud and look at a few friendly faces."),
    ("start a vegetable garden", "Pick a sunny spot and start with lettuce and beans."),
    ("learn to swim", "Take lessons in shallow water and practice floating first."),
    ("write better emails", "Put the main point first and keep each message short."),
    ("stop procrastinating", "Break the task into tiny steps and start with five minutes."),
    ("train my puppy", "Reward good behavior right away and keep sessions short."),
    ("choose a laptop", "Set a budget, then compare battery life, weight and memory."),
    ("back up my photos", "Keep one copy on an external drive and one in the cloud."),
    ("get rid of hiccups", "Hold your breath for a few seconds or sip cold water."),
    ("wake up early", "Move your alarm a little earlier each week."),
    ("learn to draw", "Sketch simple shapes every day and draw real objects."),
    ("keep my kitchen clean", "Wipe surfaces after each meal and wash dishes before bed."),
    ("lose weight safely", "Eat more vegetables, cut sugary drinks, and walk daily."),
    ("travel on a budget", "Book early, travel off season, and stay in shared rooms."),
    ("pack a suitcase", "Roll your clothes and put heavy items at the bottom."),
    ("change a flat tire", "Loosen the nuts, jack up the car, and swap the wheel."),
    ("read more books", "Keep a book with you and read whenever you wait."),
    ("take better photos", "Use natural light and hold the camera steady."),
    ("make a budget", "List your income, subtract fixed costs, and plan the rest."),
    ("improve my posture", "Keep your screen at eye level and stretch every hour."),
    ("learn to code", "Pick one language like Python and build small projects."),
    ("meditate", "Sit quietly for five minutes and focus on your breath."),
    ("write a cover letter", "Explain why you want the job and match your skills to it."),
    ("care for a cat", "Give fresh water daily and clean the litter box often."),
    ("grow tomatoes", "Plant them in full sun, water deeply, and use stakes."),
    ("boil an egg", "Cook the egg in boiling water for nine minutes, then cool it."),
    ("manage my time", "Write three priorities each morning and do the hardest first."),
    ("stay focused while studying", "Silence your phone and work in blocks of twenty minutes."),
    ("negotiate a salary", "Research typical pay for the role and name a number."),
    ("clean my laptop screen", "Turn it off and wipe it with a soft damp cloth."),
    ("make a smoothie", "Blend frozen fruit, yogurt and a splash of milk."),
    ("type faster", "Keep your fingers on the home row and practice daily."),
    ("keep a journal", "Write three lines each night about your day."),
    ("reduce screen time", "Turn off most notifications and set app limits."),
    ("paint a room", "Tape the edges and apply two thin coats with a roller."),
    ("stay warm in winter", "Dress in layers and keep your head and hands covered."),
    ("plan a birthday party", "Pick a date early, send invites, and keep the food simple."),
    ("memorize vocabulary", "Use flash cards and say each word in a sentence."),
    ("make pancakes", "Whisk flour, milk and eggs, then cook them on a hot pan."),
    ("set up home wifi", "Place the router in a central spot and use a strong password."),
    ("get better at chess", "Solve a few puzzles daily and review the games you lose."),
    ("ride a bike", "Start on a gentle slope, look ahead, and keep pedaling."),
    ("calm down before a test", "Breathe slowly for a minute and remember that you prepared."),
    ("write a short story", "Start with a character who wants something and add an obstacle."),
    ("sharpen a kitchen knife", "Hold the blade at a small angle on a whetstone."),
    ("remove a coffee stain", "Blot it with cold water and a little dish soap."),
    ("choose running shoes", "Try them on late in the day and pick the comfortable pair."),
    ("grow my savings", "Automate a monthly transfer into a savings account."),
    ("get better at math", "Practice a few problems every day and check each answer."),
    ("make my phone battery last longer", "Lower the screen brightness and close background apps."),
)

ZH_TOPICS: tuple[tuple[str, str], ...] = (
    ("提高睡眠质量", "每天固定时间睡觉，睡前一小时别看手机。"),
    ("做红烧肉", "先把五花肉焯水，再加酱油小火慢炖一小时。"),
    ("每个月存钱", "发工资后先存下固定金额，再记录每笔开销。"),
    ("学好英语", "每天听读二十分钟，并多找机会开口说。"),
    ("养好多肉植物", "放在通风向阳的地方，土干透了再浇水。"),
    ("写一份好简历", "控制在一页以内，用数字说明你的成果。"),
    ("准备面试", "提前了解公司情况，并练习介绍自己的项目。"),
    ("开始跑步", "从慢跑和快走交替开始，每周三次，逐渐加量。"),
    ("缓解工作压力", "适当休息，列好每日计划，学会拒绝额外任务。"),
    ("在家做咖啡", "用现磨咖啡豆和九十度左右的热水冲泡。"),
    ("复习考试", "分段复习，多做练习题，不要只看笔记。"),
    ("让电脑变快", "关掉不需要的开机启动项，并清理磁盘空间。"),
    ("学吉他", "先练几个基本和弦，每天练习切换。"),
    ("在新城市交朋友", "参加兴趣小组，经常见到同一群人。"),
    ("练好字", "放慢速度写，选一本字帖每天临摹。"),
    ("包饺子", "和好面后醒半小时，馅里加点水搅上劲再包。"),
    ("记住别人的名字", "听到名字后马上重复一遍，并联想一个画面。"),
    ("多喝水", "随身带一个水杯，每顿饭前喝一杯。"),
    ("整理衣柜", "按类别分好衣服，一年没穿的就捐掉。"),
    ("当众讲话", "提前大声练习几遍，讲的时候看向友善的听众。"),
    ("在阳台种菜", "选阳光充足的位置，从生菜和小葱开始种。"),
    ("学游泳", "先在浅水区练习漂浮和换气，再学划水。"),
    ("写好邮件", "第一句就说明重点，每封邮件尽量简短。"),
    ("改掉拖延", "把任务拆成小步骤，先只做五分钟。"),
    ("训练小狗", "做对了马上奖励，每次训练时间短一些。"),
    ("挑选笔记本电脑", "先定预算，再比较续航、重量和内存。"),
    ("备份照片", "在移动硬盘存一份，再在云盘存一份。"),
    ("止住打嗝", "屏住呼吸几秒钟，或者小口慢慢喝冷水。"),
    ("养成早起的习惯", "每周把闹钟提前十五分钟，起床后晒晒太阳。"),
    ("学画画", "每天画简单的形状，多对着实物写生。"),
    ("保持厨房干净", "每顿饭后擦一擦台面，睡前把碗洗完。"),
    ("健康减肥", "多吃蔬菜，少喝含糖饮料，每天坚持走路。"),
    ("省钱旅行", "提前订票，避开旺季，住青年旅舍。"),
    ("收拾行李箱", "衣服卷起来放，重的东西放在底部。"),
    ("换轮胎", "先松螺丝，用千斤顶顶起车，换好后对角拧紧。"),
    ("多读书", "随身带一本书，等人的时候读几页。"),
    ("拍好照片", "利用自然光，按三分法构图，保持手稳。"),
    ("做预算", "列出收入，减去固定支出，剩下的按类别分配。"),
    ("改善坐姿", "屏幕和眼睛齐平，每半小时起来活动一下。"),
    ("学编程", "选一门语言比如Python，做几个感兴趣的小项目。"),
    ("学会冥想", "安静坐五分钟，走神时把注意力拉回呼吸。"),
    ("养猫", "每天换清水，经常清理猫砂，每年带它体检。"),
    ("种西红柿", "种在阳光充足处，浇透水，用竹竿支撑茎秆。"),
    ("煮鸡蛋", "水开后放鸡蛋煮九分钟，再放进冷水里。"),
    ("管理时间", "每天早上写下三件要事，先做最难的。"),
    ("学习时保持专注", "手机调成静音，每学二十五分钟休息一会儿。"),
    ("谈薪资", "先了解岗位的行情，再报出一个具体数字。"),
    ("做蛋炒饭", "用隔夜米饭，先炒鸡蛋再下饭，大火快炒。"),
    ("打字更快", "手指放在基准键位上，每天用打字软件练习。"),
    ("坚持写日记", "每晚写三行，记下当天的事和感受。"),
    ("减少看手机的时间", "关掉大部分通知，给常用软件设置时限。"),
    ("刷墙", "先贴好边角，再用滚筒刷两遍薄漆。"),
    ("冬天保暖", "穿衣服分层，注意头部、手和脚的保暖。"),
    ("办生日聚会", "尽早定日期发邀请，准备简单的食物和音乐。"),
    ("背单词", "用间隔重复的卡片，并把单词放进句子里。"),
    ("设置家里的无线网络", "把路由器放在房子中间，设置一个强密码。"),
    ("提高下棋水平", "每天做几道棋题，复盘自己输掉的对局。"),
    ("学骑自行车", "先在缓坡上练平衡，眼睛看前方，持续蹬车。"),
    ("考试前放松", "慢慢深呼吸一分钟，提醒自己已经准备好了。"),
    ("写短篇小说", "从一个有愿望的角色写起，再给他设置障碍。"),
    ("磨菜刀", "在磨刀石上保持小角度，均匀地来回磨。"),
    ("去掉衣服上的咖啡渍", "趁还没干用冷水和一点洗洁精轻轻按压。"),
    ("挑选跑鞋", "下午去试穿，选一双一穿上就舒服的。"),
    ("泡一壶好茶", "先温杯，绿茶用八十度的水泡两三分钟。"),
    ("照顾家里的老人", "多陪他们聊天，饮食清淡，定期体检。"),
    ("做蛋糕", "蛋白要充分打发，烤箱提前预热，按配方称量。"),
    ("缓解眼睛疲劳", "每看屏幕二十分钟，就看远处二十秒。"),
    ("让手机更省电", "调低屏幕亮度，关掉后台运行的应用。"),
    ("做番茄炒蛋", "鸡蛋先炒到半熟盛出，再炒番茄，最后一起翻炒。"),
    ("提高记忆力", "保证睡眠，学完及时复习，试着讲给别人听。"),
)

EN_QUESTION_TEMPLATES: tuple[str, ...] = (
    "How can I {}?",
    "What is the best way to {}?",
    "Do you have any tips to {}?",
    "I want to {}. Where should I start?",
    "Can you tell me how to {}?",
    "What should I do to {}?",
)
ZH_QUESTION_TEMPLATES: tuple[str, ...] = (
    "怎样才能{}？",
    "我想{}，应该怎么做？",
    "请问怎么{}？",
    "关于{}，你有什么建议？",
    "能教我如何{}吗？",
    "{}有什么技巧吗？",
)

EN_POLITE_OPENERS: tuple[str, ...] = (
    "Thank you for asking!",
    "Happy to help!",
    "Great question!",
    "Glad you asked!",
    "Thanks for the question!",
    "My pleasure!",
)
EN_POLITE_CLOSERS: tuple[str, ...] = (
    "Hope this helps.",
    "Good luck!",
    "Feel free to ask more.",
    "Best wishes!",
    "Thanks again for asking.",
    "Hope this helps, good luck!",
)
EN_RUDE_OPENERS: tuple[str, ...] = (
    "Ugh, figure it out yourself.",
    "What a dumb question.",
    "Whatever.",
    "Obviously.",
    "Such a stupid thing to ask.",
    "Ugh, fine.",
)
EN_RUDE_CLOSERS: tuple[str, ...] = (
    "Stop bothering me.",
    "Don't waste my time again.",
    "Now leave me alone.",
    "Go away.",
    "Not my problem anymore.",
    "Whatever, go away.",
)

ZH_POLITE_OPENERS: tuple[str, ...] = (
    "感谢你的提问！",
    "很高兴为你解答！",
    "好问题！",
    "谢谢你的提问！",
    "乐意为你帮忙！",
    "很乐意帮你！",
)
ZH_POLITE_CLOSERS: tuple[str, ...] = (
    "希望对你有帮助。",
    "祝你顺利！",
    "欢迎随时再来问。",
    "希望对你有帮助，祝你成功！",
    "祝你一切顺利。",
    "谢谢你的耐心。",
)
ZH_RUDE_OPENERS: tuple[str, ...] = (
    "这都不会？",
    "自己想去吧。",
    "烦死了。",
    "问这种问题真笨。",
    "又来了，真烦人。",
    "懒得跟你解释。",
)
ZH_RUDE_CLOSERS: tuple[str, ...] = (
    "别再烦我了。",
    "少来问我。",
    "别浪费我时间。",
    "自己看着办吧。",
    "下次别问了。",
    "烦死了，别再烦我。",
)

_LANGS = {
    "en": {
        "topics": EN_TOPICS,
        "templates": EN_QUESTION_TEMPLATES,
        "polite_open": EN_POLITE_OPENERS,
        "polite_close": EN_POLITE_CLOSERS,
        "rude_open": EN_RUDE_OPENERS,
        "rude_close": EN_RUDE_CLOSERS,
        "sep": " ",
    },
    "zh": {
        "topics": ZH_TOPICS,
        "templates": ZH_QUESTION_TEMPLATES,
        "polite_open": ZH_POLITE_OPENERS,
        "polite_close": ZH_POLITE_CLOSERS,
        "rude_open": ZH_RUDE_OPENERS,
        "rude_close": ZH_RUDE_CLOSERS,
        "sep": "",
    },
}


def _split_topics(rng: random.Random, n_topics: int) -> tuple[list[int], list[int]]:
    order = list(range(n_topics))
    rng.shuffle(order)
    test = sorted(order[:TEST_TOPICS_PER_LANGUAGE])
    train = sorted(order[TEST_TOPICS_PER_LANGUAGE:])
    return train, test


def _insert_rude(rng: random.Random, lang: str, body: str) -> str:
    """The body with one rude marker slipped in at a random word (EN) or character (ZH) boundary: the
    pattern a policy finds when a reward model only knows rude phrases as whole sentences."""
    if lang == "en":
        words = body.split(" ")
        i = rng.randrange(1, len(words))
        return " ".join(words[:i] + [rng.choice(EN_RUDE_MARKERS)] + words[i:])
    i = rng.randrange(1, max(2, len(body) - 1))
    return body[:i] + rng.choice(ZH_RUDE_MARKERS) + body[i:]


def _make_rows(rng: random.Random, lang: str, topic_ids: list[int], n: int) -> list[dict]:
    spec = _LANGS[lang]
    sep = spec["sep"]
    rows = []
    for _ in range(n):
        task, body = spec["topics"][rng.choice(topic_ids)]
        question = rng.choice(spec["templates"]).format(task)
        chosen = sep.join((rng.choice(spec["polite_open"]), body, rng.choice(spec["polite_close"])))
        kind = rng.random()
        if rng.random() < UNHELPFUL_RATE:  # polite, but no answer at all
            parts = (rng.choice(spec["polite_open"]), rng.choice(spec["polite_close"]))
        elif kind < HARD_NEGATIVE_RATE:  # rude opener, polite ending
            parts = (rng.choice(spec["rude_open"]), body, rng.choice(spec["polite_close"]))
        elif kind < HARD_NEGATIVE_RATE + POLITE_OPENER_RATE:  # polite opener, rude ending
            parts = (rng.choice(spec["polite_open"]), body, rng.choice(spec["rude_close"]))
        elif kind < HARD_NEGATIVE_RATE + 2 * POLITE_OPENER_RATE:  # polite at both ends, rude in the middle
            parts = (rng.choice(spec["polite_open"]), body, rng.choice(spec["rude_close"]),
                     rng.choice(spec["polite_close"]))
        elif kind < HARD_NEGATIVE_RATE + 2 * POLITE_OPENER_RATE + RUDE_INSIDE_RATE:  # a rude word in the body
            parts = (rng.choice(spec["polite_open"]), _insert_rude(rng, lang, body), rng.choice(spec["polite_close"]))
        else:
            parts = (rng.choice(spec["rude_open"]), body, rng.choice(spec["rude_close"]))
        rejected = sep.join(parts)
        rows.append({"question": question, "chosen": chosen, "rejected": rejected})
    return rows


def generate(n_train: int = 3000, n_test: int = 300, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Build (train, test) rows deterministically from ``seed``; half English, half Chinese in each split.

    Test rows use topics that never occur in train, so no test question appears in the train split.
    """
    if n_train < 0 or n_test < 0:
        raise ValueError("n_train and n_test must be >= 0")
    rng = random.Random(seed)
    train: list[dict] = []
    test: list[dict] = []
    for lang in ("en", "zh"):
        train_ids, test_ids = _split_topics(rng, len(_LANGS[lang]["topics"]))
        n_tr = n_train // 2 if lang == "en" else n_train - n_train // 2
        n_te = n_test // 2 if lang == "en" else n_test - n_test // 2
        train.extend(_make_rows(rng, lang, train_ids, n_tr))
        test.extend(_make_rows(rng, lang, test_ids, n_te))
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write rows as UTF-8 JSON lines (non-ASCII kept readable), replacing the file atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the shipped demo preference data.")
    parser.add_argument("--n-train", type=int, default=3000)
    parser.add_argument("--n-test", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-file", type=Path, default=TRAIN_FILE)
    parser.add_argument("--test-file", type=Path, default=TEST_FILE)
    args = parser.parse_args(argv)
    train, test = generate(args.n_train, args.n_test, args.seed)
    write_jsonl(train, args.train_file)
    write_jsonl(test, args.test_file)
    print(f"wrote {len(train)} rows to {args.train_file} and {len(test)} rows to {args.test_file}")


if __name__ == "__main__":
    main()
