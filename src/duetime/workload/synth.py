"""A SYNTHETIC judged data set: realistic-looking prompts per task, with quality, output
length and correctness drawn from a known generator, so the predictors have something to learn
and tests have data. Every row says ``"synthetic": true``; nothing here was judged by a model.

Tasks, models, task shares, prompt and output lengths and the per-(task, model) accuracy come
from a workload profile (``duetime.workload``; default ``paper``: the SFS paper's four tasks
and three Qwen3 models). The prompts per task: ``alpaca`` short instructions (some with an
input text), ``hotpotqa`` titled passages + a multi-hop question, ``govreport`` a sectioned
report + "summarise", ``writingprompts`` a ``[WP]`` story premise; a task the generator does
not know gets alpaca-style prompts. Prompts are filled with topic sentences up to a length
drawn from the profile's ``prompt_tokens`` (measured with the fast token estimate); some are
Chinese, Japanese or Korean; some come as chat ``messages``; a few omit ``task``.

The generator's truth, per (prompt, model) — what a learner can recover from the text:

* quality logit = logit(profile accuracy of (task, model)) - sensitivity(model) x (topic
  difficulty + 0.45 x hard keywords) - slope(model) x ln(tokens / task's median length)
  - language penalty(model, language) + a per-prompt effect + noise. A model's sensitivity,
  length slope and language penalty grow as its mean accuracy falls: smaller models suffer
  more from hard topics and keywords ("prove", "step by step", ...), long prompts and
  languages other than English. ``score`` = sigmoid(logit + judge noise), 3 decimals.
* ``correct`` ~ Bernoulli(sigmoid(logit - 0.4 x sensitivity x log2(tokens / 4096) beyond
  4096 tokens)): LAAR's finding that exact answers fail more often as the context grows,
  more so for weaker models.
* ``output_tokens`` ~ log-normal around the profile's per-task median x the model's
  ``output_scale``, scaled by "briefly" / "in detail" / "step by step" in the prompt, by the
  report's length (govreport) and by language.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duetime.predict.text_scan import scan_text
from duetime.predict.tokens import FAST
from duetime.workload.profile import load_workload

LANGUAGE_MIX = {  # en, zh, ja, ko
    "alpaca": (0.82, 0.06, 0.06, 0.06), "hotpotqa": (0.85, 0.05, 0.05, 0.05),
    "govreport": (0.94, 0.02, 0.02, 0.02), "writingprompts": (0.88, 0.04, 0.04, 0.04)}
DEFAULT_LANGUAGE_MIX = (0.85, 0.05, 0.05, 0.05)
LANGUAGE_BASE_PENALTY = {"en": 0.0, "zh": 0.3, "ja": 0.55, "ko": 0.6}
NO_TASK_SHARE = 0.05     # prompts whose rows omit "task" (exercises task inference)
MESSAGES_SHARE = 0.2     # prompts given as chat messages instead of "prompt"


def model_traits(mean_accuracy: float) -> tuple[float, float]:
    """(sensitivity, length slope) of a model from its mean accuracy over tasks: weaker
    models are more sensitive (qwen3-0.6b ~1.7 / 0.49, qwen3-32b ~0.6 / 0.05 on the paper
    profile)."""
    gap = 0.9 - mean_accuracy
    return min(max(0.6 + 2.0 * gap, 0.5), 2.0), min(max(0.05 + 0.8 * gap, 0.03), 0.8)


@dataclass(frozen=True)
class Topic:
    difficulty: float
    en: tuple[str, ...]
    zh: tuple[str, ...]
    ja: tuple[str, ...]
    ko: tuple[str, ...]


def _t(difficulty: float, en: str, zh: str, ja: str, ko: str) -> Topic:
    return Topic(difficulty, tuple(en.split()), tuple(zh.split()), tuple(ja.split()),
                 tuple(ko.split()))


TOPICS: dict[str, Topic] = {
    "mathematics": _t(
        0.9, "theorem integral derivative matrix eigenvalue polynomial proof equation lemma "
        "vector probability series limit topology manifold",
        "定理 积分 导数 矩阵 证明 方程 概率", "定理 積分 微分 行列 証明 方程式 確率",
        "정리 적분 미분 행렬 증명 방정식 확률"),
    "programming": _t(
        0.7, "function compiler pointer recursion regex database thread interface algorithm "
        "variable loop exception parser kernel cache",
        "函数 编译器 指针 递归 数据库 算法 变量",
        "関数 コンパイラ ポインタ 再帰 データベース アルゴリズム 変数",
        "함수 컴파일러 포인터 재귀 데이터베이스 알고리즘 변수"),
    "law": _t(
        0.5, "statute plaintiff contract liability jurisdiction court defendant regulation "
        "appeal clause tribunal precedent verdict tort ordinance",
        "法规 原告 合同 责任 管辖 法院 被告", "法令 原告 契約 責任 管轄 裁判所 被告",
        "법령 원고 계약 책임 관할 법원 피고"),
    "medicine": _t(
        0.4, "diagnosis symptom dosage patient vaccine therapy clinic infection surgeon "
        "antibiotic tumor prescription syndrome immunity cardiology",
        "诊断 症状 剂量 病人 疫苗 治疗 感染", "診断 症状 用量 患者 ワクチン 治療 感染",
        "진단 증상 용량 환자 백신 치료 감염"),
    "finance": _t(
        0.3, "interest bond inflation portfolio dividend equity loan budget deficit revenue "
        "audit tariff mortgage liquidity investor",
        "利率 债券 通货膨胀 投资 股息 贷款 预算", "金利 債券 インフレ 投資 配当 ローン 予算",
        "금리 채권 인플레이션 투자 배당 대출 예산"),
    "history": _t(
        0.0, "empire treaty dynasty revolution monarch battle colony parliament kingdom "
        "archive chronicle rebellion emperor province republic",
        "帝国 条约 王朝 革命 君主 战役 殖民地", "帝国 条約 王朝 革命 君主 戦い 植民地",
        "제국 조약 왕조 혁명 군주 전투 식민지"),
    "sports": _t(
        -0.3, "match tournament coach goal league stadium athlete season championship "
        "referee striker marathon medal team playoff",
        "比赛 锦标赛 教练 联赛 体育场 运动员 赛季",
        "試合 トーナメント コーチ リーグ スタジアム 選手 シーズン",
        "경기 토너먼트 코치 리그 경기장 선수 시즌"),
    "travel": _t(
        -0.4, "itinerary museum train hotel passport beach airport luggage cathedral ferry "
        "village market harbor tour visa",
        "行程 博物馆 火车 酒店 护照 海滩 机场", "旅程 博物館 電車 ホテル パスポート ビーチ 空港",
        "일정 박물관 기차 호텔 여권 해변 공항"),
    "cooking": _t(
        -0.5, "recipe flour oven garlic sauce butter dough spice kitchen soup onion pastry "
        "grill dessert noodle",
        "食谱 面粉 烤箱 大蒜 酱汁 黄油 面团", "レシピ 小麦粉 オーブン ニンニク ソース バター 生地",
        "요리법 밀가루 오븐 마늘 소스 버터 반죽"),
    "nature": _t(
        -0.2, "forest river glacier species wetland mountain ecosystem rainfall coral meadow "
        "wildlife volcano desert estuary pollinator",
        "森林 河流 冰川 物种 湿地 山脉 生态系统", "森林 川 氷河 種 湿地 山脈 生態系",
        "숲 강 빙하 종 습지 산맥 생태계"),
}



def _words(text: str, sep: str | None = None) -> tuple[str, ...]:
    return tuple(text.split(sep))


ADJECTIVES = _words("important new local large recent significant careful early central "
                    "detailed common formal simple regional annual modern public private major "
                    "minor")
VERBS = _words("affects describes improves requires supports changes explains reduces shapes "
               "examines replaces follows limits reveals")
BASE = _words("study review propose describe change measure examine reject approve found "
              "publish revise")
PAST = _words("studied reviewed proposed described changed measured examined rejected approved "
              "founded published revised")
PREPS = _words("in with for near after before under across within without")
NAMES = _words("Alice Moreau,Daniel Okafor,Mei Tanaka,Carlos Ruiz,Priya Nair,Johan Berg,"
               "Lena Fischer,Samuel Adeyemi,Yuki Sato,Omar Haddad,Grace Liu,Tomas Novak", ",")
PLACES = _words("Lisbon Nairobi Osaka Denver Krakow Valparaiso Hobart Tromso Marseille Accra "
                "Winnipeg Busan")

HARD_EN = ("Prove each claim formally.", "Explain your reasoning step by step.",
           "Answer exactly, without rounding.", "Consider every edge case.",
           "Derive the result without using a calculator.", "Give a counterexample if one exists.")
BRIEF_EN = ("Answer briefly.", "Keep it to one sentence.")
DETAIL_EN = ("Explain in detail.", "Write a thorough, detailed answer.")
HARD_CJK = {"zh": "请逐步证明你的结论。", "ja": "結論を段階的に証明してください。",
            "ko": "결론을 단계별로 증명해 주세요."}
BRIEF_CJK = {"zh": "请简要回答。", "ja": "簡潔に答えてください。", "ko": "간단히 답해 주세요."}
DETAIL_CJK = {"zh": "请详细说明。", "ja": "詳しく説明してください。", "ko": "자세히 설명해 주세요."}

CJK_SENTENCES = {
    "zh": ("{a}的{b}对{c}有重要影响。", "关于{a}，我们需要了解{b}和{c}之间的关系。",
           "这个{a}说明了{b}的作用。", "研究人员发现{a}与{b}密切相关。",
           "在过去的十年里，{a}和{b}都发生了很大的变化。"),
    "ja": ("{a}の{b}は{c}に大きな影響を与えます。",
           "{a}について、{b}と{c}の関係を理解する必要があります。",
           "この{a}は{b}の役割を示しています。", "研究者は{a}が{b}と深く関係していることを発見しました。",
           "過去十年で、{a}と{b}は大きく変わりました。"),
    "ko": ("{a}의 {b}은(는) {c}에 큰 영향을 줍니다.",
           "{a}에 대해 {b}와(과) {c}의 관계를 이해해야 합니다.",
           "이 {a}은(는) {b}의 역할을 보여 줍니다.",
           "연구자들은 {a}이(가) {b}와(과) 밀접하게 관련되어 있다는 것을 발견했습니다.",
           "지난 10년 동안 {a}와(과) {b}은(는) 크게 변했습니다."),
}
CJK_INSTRUCTIONS = {
    "zh": ("请解释{a}和{b}的区别。", "请简单介绍一下{a}。", "请写一段关于{a}的短文。"),
    "ja": ("{a}と{b}の違いを説明してください。", "{a}について簡単に紹介してください。",
           "{a}についての短い文章を書いてください。"),
    "ko": ("{a}와(과) {b}의 차이를 설명해 주세요.", "{a}에 대해 간단히 소개해 주세요.",
           "{a}에 관한 짧은 글을 써 주세요."),
}
CJK_QUESTION = {"zh": "根据上述段落回答问题：{a}和{b}有什么关系？",
                "ja": "上記の文章に基づいて質問に答えてください：{a}と{b}の関係は何ですか？",
                "ko": "위 단락을 바탕으로 질문에 답하세요: {a}와(과) {b}의 관계는 무엇입니까?"}
CJK_SUMMARISE = {"zh": "请总结上述报告。", "ja": "上記の報告書を要約してください。",
                 "ko": "위 보고서를 요약해 주세요."}
CJK_STORY = {"zh": "写一个故事：有一天，世界上所有的{a}都消失了。",
             "ja": "物語を書いてください：ある朝、世界中の{a}がすべて消えていました。",
             "ko": "이야기를 써 주세요: 어느 날 아침, 세상의 모든 {a}이(가) 사라졌습니다."}


def _tokens(text: str) -> int:
    _, stats = scan_text(text)
    return FAST.count(text, stats)


class _Writer:
    """Sentences per (language, topic), with their token counts, to fill prompts quickly."""

    def __init__(self, rng: random.Random, per_pool: int = 160) -> None:
        self.rng = rng
        self.pools: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for topic in TOPICS:
            for lang in ("en", "zh", "ja", "ko"):
                pool = [self._sentence(lang, topic) for _ in range(per_pool)]
                self.pools[(lang, topic)] = [(s, _tokens(s)) for s in pool]

    def _sentence(self, lang: str, topic: str) -> str:
        r = self.rng
        t = TOPICS[topic]
        if lang != "en":
            words = getattr(t, lang)
            a, b, c = r.choice(words), r.choice(words), r.choice(words)
            return r.choice(CJK_SENTENCES[lang]).format(a=a, b=b, c=c)
        n = t.en
        forms = (
            f"The {r.choice(ADJECTIVES)} {r.choice(n)} {r.choice(VERBS)} the {r.choice(n)} "
            f"{r.choice(PREPS)} the {r.choice(ADJECTIVES)} {r.choice(n)}.",
            f"{r.choice(NAMES)} {r.choice(PAST)} the {r.choice(n)} of {r.choice(PLACES)} in "
            f"{r.randint(1890, 2024)}.",
            f"According to the {r.choice(ADJECTIVES)} report, each {r.choice(n)} "
            f"{r.choice(VERBS)} a {r.choice(n)}, and the {r.choice(n)} {r.choice(VERBS)} "
            f"{r.randint(2, 90)} percent of the {r.choice(n)}.",
            f"Critics argue that the {r.choice(n)} {r.choice(VERBS)} the "
            f"{r.choice(ADJECTIVES)} {r.choice(n)}.",
            f"In {r.choice(PLACES)}, a {r.choice(ADJECTIVES)} {r.choice(n)} was "
            f"{r.choice(PAST)} {r.choice(PREPS)} the {r.choice(n)}.",
        )
        return r.choice(forms)

    def fill(self, lang: str, topic: str, tokens: int, sep: str = " ") -> tuple[str, int]:
        """Sentences of the topic until about ``tokens`` tokens."""
        pool = self.pools[(lang, topic)]
        out: list[str] = []
        total = 0
        while total < tokens:
            s, k = self.rng.choice(pool)
            out.append(s)
            total += k
        joiner = "" if lang in ("zh", "ja") else sep
        return joiner.join(out), total

    def paragraphs(self, lang: str, topic: str, tokens: int, per: int = 120) -> str:
        parts = []
        left = tokens
        while left > 0:
            text, k = self.fill(lang, topic, min(per, left))
            parts.append(text)
            left -= k
        return "\n\n".join(parts)


@dataclass
class _Prompt:
    text: str
    lang: str
    topic: str
    hard: int
    brief: bool
    detail: bool
    steps: bool


def _target(rng: random.Random, prompt: Any) -> int:
    """A prompt length from the profile's clipped log-normal."""
    x = math.exp(rng.gauss(math.log(prompt.median), prompt.sigma))
    return int(min(max(round(x), prompt.lo), prompt.hi))


def _modifiers(rng: random.Random, lang: str, p_hard: float) -> tuple[list[str], int, bool,
                                                                       bool, bool]:
    extra: list[str] = []
    hard = 0
    steps = False
    if rng.random() < p_hard:
        k = 1 if rng.random() < 0.7 else 2
        if lang == "en":
            picks = rng.sample(HARD_EN, k)
            steps = any("step by step" in p for p in picks)
            extra += picks
        else:
            extra.append(HARD_CJK[lang])
            steps = True
            k = 1
        hard = k
    brief = rng.random() < 0.15
    detail = not brief and rng.random() < 0.15
    if brief:
        extra.append(rng.choice(BRIEF_EN) if lang == "en" else BRIEF_CJK[lang])
    if detail:
        extra.append(rng.choice(DETAIL_EN) if lang == "en" else DETAIL_CJK[lang])
    return extra, hard, brief, detail, steps


def _alpaca(w: _Writer, rng: random.Random, lang: str, topic: str, target: int) -> _Prompt:
    extra, hard, brief, detail, steps = _modifiers(rng, lang, 0.3)
    t = TOPICS[topic]
    if lang == "en":
        a, b = rng.sample(t.en, 2)
        head = rng.choice((
            f"Explain what a {a} is to a beginner.", f"Give three tips for working with a {a}.",
            f"Write a short paragraph about the {a}.",
            f"What is the difference between a {a} and a {b}?", f"List five facts about the {a}.",
            "Summarize the following text in one sentence.",
            "Rewrite the following text in a formal tone.",
            "Classify the sentiment of the following text as positive or negative."))
        text = " ".join([head, *extra])
        left = target - _tokens(text)
        if left > 6:
            body, _ = w.fill(lang, topic, left)
            text += "\n\nInput: " + body
    else:
        words = getattr(t, lang)
        a, b = rng.sample(words, 2)
        text = rng.choice(CJK_INSTRUCTIONS[lang]).format(a=a, b=b) + "".join(extra)
        left = target - _tokens(text)
        if left > 6:
            body, _ = w.fill(lang, topic, left)
            text += "\n\n" + body
    return _Prompt(text, lang, topic, hard, brief, detail, steps)


def _hotpotqa(w: _Writer, rng: random.Random, lang: str, topic: str, target: int) -> _Prompt:
    extra, hard, brief, detail, steps = _modifiers(rng, lang, 0.25)
    t = TOPICS[topic]
    if lang == "en":
        parts = ["Answer the question based on the passages below."]
        left = target - 40
        while left > 0:
            name = rng.choice(NAMES)
            body, k = w.fill(lang, topic, min(left, rng.randint(80, 220)))
            parts.append(f"Title: {name} ({rng.choice(t.en)})\n{body}")
            left -= k + 6
        a, b = rng.sample(t.en, 2)
        q = (f"Question: Which {a} did {rng.choice(NAMES)} {rng.choice(BASE)} before the "
             f"{b} of {rng.choice(PLACES)} was {rng.choice(PAST)}?")
        parts.append(" ".join([q, *extra]) + "\nAnswer:")
        text = "\n\n".join(parts)
    else:
        words = getattr(t, lang)
        a, b = rng.sample(words, 2)
        body = w.paragraphs(lang, topic, target - 30, per=rng.randint(80, 200))
        text = body + "\n\n" + CJK_QUESTION[lang].format(a=a, b=b) + "".join(extra)
    return _Prompt(text, lang, topic, hard, brief, detail, steps)


def _govreport(w: _Writer, rng: random.Random, lang: str, topic: str, target: int) -> _Prompt:
    extra, hard, brief, detail, steps = _modifiers(rng, lang, 0.15)
    t = TOPICS[topic]
    if lang == "en":
        sections = ("Background", "Objectives, Scope, and Methodology", "Findings",
                    "Agency Comments", "Recommendations", "Appendix")
        title = (f"Report: The {rng.choice(ADJECTIVES).title()} {rng.choice(t.en).title()} "
                 f"Program in {rng.choice(PLACES)}")
        per = max(60, (target - 40) // len(sections))
        parts = [title]
        for s in sections:
            parts.append(s + "\n" + w.paragraphs(lang, topic, per, per=rng.randint(120, 300)))
        parts.append(" ".join(["Summarize the report above.", *extra]))
        text = "\n\n".join(parts)
    else:
        body = w.paragraphs(lang, topic, target - 20, per=rng.randint(120, 300))
        text = body + "\n\n" + CJK_SUMMARISE[lang] + "".join(extra)
    return _Prompt(text, lang, topic, hard, brief, detail, steps)


def _writingprompts(w: _Writer, rng: random.Random, lang: str, topic: str,
                    target: int) -> _Prompt:
    extra, hard, brief, detail, steps = _modifiers(rng, lang, 0.1)
    t = TOPICS[topic]
    if lang == "en":
        a, b = rng.sample(t.en, 2)
        head = rng.choice((
            f"[WP] You wake up one morning to find that every {a} in the world has vanished.",
            f"[WP] A retired {a} expert and a nervous {b} must save {rng.choice(PLACES)} "
            "before sunrise.",
            f"[WP] The last {a} on Earth writes a letter to the first {b}.",
            f"[WP] In {rng.randint(2100, 2900)}, a {a} becomes the most valuable thing "
            "anyone owns."))
        text = " ".join([head, *extra])
        left = target - _tokens(text)
        if left > 8:
            body, _ = w.fill(lang, topic, left)
            text += " " + body
    else:
        a = rng.choice(getattr(t, lang))
        text = CJK_STORY[lang].format(a=a) + "".join(extra)
        left = target - _tokens(text)
        if left > 8:
            body, _ = w.fill(lang, topic, left)
            text += body
    return _Prompt(text, lang, topic, hard, brief, detail, steps)


_MAKERS = {"alpaca": _alpaca, "hotpotqa": _hotpotqa, "govreport": _govreport,
           "writingprompts": _writingprompts}


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def synth_rows(n: int, seed: int = 0, workload: str = "paper") -> Iterator[dict[str, Any]]:
    """Rows for ``n`` prompts (one row per prompt and model of the workload profile), seeded.
    ``workload``: a built-in profile name or a YAML file (``duetime.workload``)."""
    prof = load_workload(workload)
    models, tasks = prof.model_names, prof.task_names
    shares = [prof.tasks[t].share for t in tasks]
    traits = {m: model_traits(sum(prof.tasks[t].accuracy[m] for t in tasks) / len(tasks))
              for m in models}
    rng = random.Random(seed)
    writer = _Writer(random.Random(seed + 1))
    langs = ("en", "zh", "ja", "ko")
    topics = list(TOPICS)
    for i in range(n):
        task = rng.choices(tasks, weights=shares)[0]
        spec = prof.tasks[task]
        lang = rng.choices(langs, weights=LANGUAGE_MIX.get(task, DEFAULT_LANGUAGE_MIX))[0]
        topic = rng.choice(topics)
        p = _MAKERS.get(task, _alpaca)(writer, rng, lang, topic, _target(rng, spec.prompt))
        tokens = _tokens(p.text)
        prompt_effect = rng.gauss(0.0, 0.35)
        as_messages = rng.random() < MESSAGES_SHARE
        give_task = rng.random() >= NO_TASK_SHARE
        for model in models:
            sens, slope = traits[model]
            acc = min(max(spec.accuracy[model], 0.01), 0.99)
            z = (_logit(acc) - sens * (0.8 * TOPICS[topic].difficulty + 0.45 * p.hard)
                 - slope * math.log(max(tokens, 1) / spec.prompt.median)
                 - sens * LANGUAGE_BASE_PENALTY[lang] + prompt_effect + rng.gauss(0.0, 0.25))
            score = round(_sigmoid(z + rng.gauss(0.0, 0.3)), 3)
            long_context = max(0.0, math.log2(max(tokens, 1) / 4096))
            p_correct = _sigmoid(z - 0.4 * sens * long_context)
            correct = rng.random() < p_correct
            mult = spec.output_scale[model]
            if p.brief:
                mult *= 0.35
            if p.detail:
                mult *= 1.8
            if p.steps:
                mult *= 3.0 if task == "hotpotqa" else 1.5
            if task == "govreport":
                mult *= (tokens / spec.prompt.median) ** 0.3
            if lang != "en":
                mult *= 1.1
            sigma = spec.output.sigma * (0.8 + 0.4 * sens)  # weaker models vary more
            out = spec.output.median * mult * math.exp(rng.gauss(0.0, sigma))
            out_tokens = int(min(max(round(out), 1), 4 * spec.output.hi))
            row: dict[str, Any] = {"id": f"synth-{i:06d}", "synthetic": True}
            if as_messages:
                row["messages"] = [{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": p.text}]
            else:
                row["prompt"] = p.text
            if give_task:
                row["task"] = task
            row.update({"model": model, "score": score, "output_tokens": out_tokens,
                        "correct": correct,
                        "meta": {"language": lang, "topic": topic, "hard_keywords": p.hard,
                                 "prompt_tokens_estimate": tokens,
                                 "true_quality": round(_sigmoid(z), 4),
                                 "p_correct": round(p_correct, 4),
                                 "median_output_tokens": round(spec.output.median * mult, 1)}})
            yield row


def write_synth(path: str | Path, n: int, seed: int = 0, workload: str = "paper") -> int:
    """Write :func:`synth_rows` as JSONL; return the number of rows. The workload is loaded
    first and the file written via a temporary name, so a failure leaves no partial file."""
    load_workload(workload)  # fail before touching the file
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in synth_rows(n, seed, workload):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                count += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count
