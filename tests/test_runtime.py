"""runtime's worker results: what one rank prints, another process reads back, also when ranks' lines mix."""

from thunder_fsdp_mem.training import runtime


def test_results_are_read_back_also_when_two_ranks_lines_ran_together(capsys):
    runtime.print_result({"rank": 0, "peak": 1})
    runtime.print_result({"rank": 1, "peak": [2, 3]})
    one_line = capsys.readouterr().out
    assert one_line.count("\n") == 2
    mixed = one_line.replace("\n", "", 1) + "W1130 a warning line\n"  # two results on one line, then noise
    assert runtime.read_results(mixed) == [{"rank": 0, "peak": 1}, {"rank": 1, "peak": [2, 3]}]
    assert runtime.read_results("no results here") == []
