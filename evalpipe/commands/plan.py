"""`evalpipe plan`: how many questions (and repeats) a non-inferiority margin needs, before the runs."""

from __future__ import annotations

import json

import click


def _rate(ctx, param, value):
    if value is not None and not 0 <= value < 1:
        raise click.BadParameter("a share in [0, 1), e.g. 0.05 for 5%")
    return value


@click.command(name="plan", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--margin",
    "margin_pts",
    type=click.FloatRange(0, 100, min_open=True, max_open=True),
    default=1.0,
    show_default=True,
    help="Pre-registered non-inferiority margin in accuracy points (as compare --margin).",
)
@click.option(
    "--discordance",
    type=float,
    default=None,
    callback=_rate,
    metavar="SHARE",
    help="Greedy lanes: expected share of questions answered right by exactly one arm (e.g. 0.05). "
    "0 plans for not a single flip. Overrides what --pilot gives.",
)
@click.option(
    "--pilot",
    "pilots",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    metavar="RUN_DIR",
    help="A pilot run folder (once: one arm's accuracy, and for a repeated lane its intra-question "
    "correlation) or two (twice: arms A and B of one lane, their discordance or variances).",
)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=None,
    help="Repeated lanes: responses per question to plan for [default: the aime26-x16 lane's 16].",
)
@click.option(
    "--icc",
    type=click.FloatRange(0, 1, max_open=True),
    default=None,
    help="Repeated lanes: intra-question correlation of correctness [default 0, the most variance; "
    "a repeated --pilot estimates it].",
)
@click.option(
    "--accuracy",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=None,
    help="Repeated lanes: mean accuracy per response [default 0.5, the most variance; a --pilot gives it].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of text.")
def command(margin_pts, discordance, pilots, repeats, icc, accuracy, as_json):
    """Questions and repeats needed for a non-inferiority verdict at --margin, and the smallest detectable drop
    (80% power, alpha 0.05) of each lane as configured: gsm8k 1,314 questions, arith 1,200, aime26-x16 30 x 16.

    \b
    Greedy lanes: exact power of compare's verdict (Tango's interval) over the binomial distribution of flips
    at the given discordance. Repeated lanes: the question-clustered t interval, with the variance split into
    a within-question part (shrinks with repeats) and a between-question part (shrinks only with questions).
    Examples:
      evalpipe plan --margin 1 --discordance 0.02
      evalpipe plan --margin 2 --pilot results/gsm8k/spec_off-1 --pilot results/gsm8k/spec_on-1
      evalpipe plan --margin 5 --repeats 32 --icc 0.6 --accuracy 0.4
    """
    from evalpipe.commands.errors import BadInput
    from evalpipe.compare.planning import Assumptions, assumptions_from, plan
    from evalpipe.compare.runfolder import RunFolderError

    if len(pilots) > 2:
        raise click.UsageError("--pilot is given once (one arm) or twice (arms A and B)")
    base = Assumptions()
    try:
        assume = assumptions_from(list(pilots), base)
    except RunFolderError as exc:
        raise BadInput(str(exc)) from None
    if discordance is not None:
        assume.discordance, assume.discordance_source = discordance, "given"
    if accuracy is not None:
        assume.accuracy, assume.repeated_source, assume.measured_within = accuracy, "given", None
    if icc is not None:
        assume.icc, assume.repeated_source, assume.measured_within = icc, "given", None
    result = plan(margin_pts, assume, repeats)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for line in plan_lines(result):
        click.echo(line)


def plan_lines(result: dict) -> list[str]:
    m = f"-{result['margin_pts']:g} pt"
    g, r = result["greedy"], result["repeated"]
    lines = [f"plan for non-inferiority at {m} (80% power when the arms are equal, alpha 0.05 two-sided)"]
    if g["discordance"] is None:
        lines.append(
            "greedy lanes: give --discordance or --pilot to plan them; with no flip at all "
            f"{m} needs {g['questions_needed_if_no_flips']} questions"
        )
    else:
        lines.append(
            f"greedy lanes: discordance {100 * g['discordance']:.2f}% ({g['source']}): {m} needs "
            f"{g['questions_needed']} questions (power {100 * g['power_at_questions_needed']:.1f}%); "
            f"with no flip at all, {g['questions_needed_if_no_flips']}"
        )
    lines.append(
        f"repeated lanes: accuracy {100 * r['accuracy']:.1f}%, intra-question correlation {r['icc']:.2f}, "
        f"between-question variance {r['between_variance']:.4g} ({r['source']}): at {r['repeats']} repeats "
        f"per question {m} needs {_n(r['questions_needed'])} questions"
    )
    lines.append(
        "lane         design      smallest detectable drop   supports margin   questions needed   repeats needed"
    )
    for row in result["lanes"]:
        mde = "n/a" if row["mde_pts"] is None else f"{row['mde_pts']:.2f} pt"
        ok = "n/a" if row["supports_margin"] is None else ("yes" if row["supports_margin"] else "no")
        design = f"{row['questions']} x {row['repeats']}"
        planned = row["kind"] == "repeated" or g["discordance"] is not None
        need_q = _n(row["questions_needed"]) if planned else "n/a"
        lines.append(
            f"{row['lane']:<12} {design:<11} {mde:<26} {ok:<17} {need_q:<18} "
            f"{_n(row['repeats_needed']) if row['kind'] == 'repeated' else '-'}"
        )
    return lines


def _n(x) -> str:
    return "n/a (unreachable)" if x is None else f"{x}"
