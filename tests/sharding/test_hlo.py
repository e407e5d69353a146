"""Reading collectives out of HLO text: shapes, replica groups, loops, ring bytes."""

import pytest

from gspmd_tp.sharding import hlo

# fmt: off
PROGRAM = """\
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p.1), index=1
  %ar = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(f)/layer/dot"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i2, %ar)
}

ENTRY %main (a: f32[8], b: bf16[4,2]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %ag = bf16[4,8]{1,0} all-gather(%b), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={1}
  %rs = (f32[2]{0}, f32[1]{0}) reduce-scatter(%a, %a), channel_id=3, replica_groups=mesh['x'=2,'y'=4] {'y'}, dimensions={0}
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %w2 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""  # noqa: E501
# fmt: on


def test_loops_multiply_and_trip_counts_come_from_config_or_condition():
    runs = hlo.executions(PROGRAM)
    assert runs["body"] == 3 + 5  # known_trip_count 3; the second loop's condition compares with 5
    assert runs["main"] == 1


def test_collectives_bytes_groups_and_counts():
    found = {c.name: c for c in hlo.collectives(PROGRAM, num_devices=8)}
    assert found["ag"].result_bytes == 4 * 8 * 2 and found["ag"].group_size == 4
    assert found["rs"].result_bytes == 3 * 4 and found["rs"].group_size == 4
    assert found["ar"].group_size == 4 and found["ar"].executions == 8
    assert found["ar"].op_name == "jit(f)/layer/dot"
    assert [found[n].dtype for n in ("ag", "rs", "ar")] == ["bf16", "f32", "f32"]


def test_a_bf16_all_reduce_xla_cpu_promoted_keeps_its_dtype():
    """XLA:CPU runs a bf16 all-reduce in f32 and names its reduction *_promoted: it moves f32, and
    counts as bf16 in as_asked."""
    line = (
        "  %arp = f32[16]{0} all-reduce(%a), channel_id=4, replica_groups=[1,8]<=[8], "
        "to_apply=%add.1.clone_promoted"
    )
    program = PROGRAM.replace("  %w = (s32[]", line + "\n  %w = (s32[]", 1)
    found = {c.name: c for c in hlo.collectives(program, num_devices=8)}
    assert found["arp"].dtype == "bf16" and found["arp"].promoted and found["arp"].result_bytes == 16 * 4
    asked = {c.name: c for c in hlo.as_asked(list(found.values()))}
    assert asked["arp"].result_bytes == 16 * 2 and asked["ar"].result_bytes == 8 * 4
    assert hlo.summarize(list(found.values()))["all-reduce"]["dtypes"] == ["f32", "bf16"]


def test_ring_bytes():
    ar = hlo.Collective("all-reduce", "a", "c", 1000, 4, 1)
    ag = hlo.Collective("all-gather", "a", "c", 1000, 4, 1)
    rs = hlo.Collective("reduce-scatter", "a", "c", 250, 4, 1)
    assert ar.ring_bytes == pytest.approx(1500)
    assert ag.ring_bytes == pytest.approx(750)
    assert rs.ring_bytes == pytest.approx(750)  # the same bytes as the all-gather it mirrors
    assert hlo.Collective("all-reduce", "a", "c", 1000, 1, 1).ring_bytes == 0


def test_summary_applies_executions():
    summary = hlo.summarize(hlo.collectives(PROGRAM, num_devices=8))
    assert summary["all-reduce"]["count"] == 8
    assert summary["all-reduce"]["bytes"] == 8 * 32
    assert summary["all-to-all"]["count"] == 0


def test_unreadable_trip_count_is_an_error():
    broken = PROGRAM.replace("%n = s32[] constant(5)", "%n = s32[] parameter(1)")
    with pytest.raises(ValueError, match="trip count"):
        hlo.executions(broken)


def test_tpu_fused_all_reduce_scatter_counts_as_a_reduce_scatter():
    text = """\
%all-reduce-scatter (input: f32[4,128,256]) -> f32[4,32,256] {
  %input = f32[4,128,256]{2,1,0} parameter(0)
  %all-reduce.2 = f32[4,128,256]{2,1,0} all-reduce(%input), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}
  ROOT %dynamic-slice.6 = f32[4,32,256]{2,1,0} dynamic-slice(%all-reduce.2, %c, %m, %c)
}

ENTRY %main (p: f32[4,128,256]) -> f32[4,32,256] {
  %p = f32[4,128,256]{2,1,0} parameter(0)
  ROOT %f = f32[4,32,256]{2,1,0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter
}
"""
    (found,) = hlo.collectives(text, num_devices=8)
    assert found.kind == "reduce-scatter" and found.executions == 1
    assert found.result_bytes == 4 * 32 * 256 * 4
    assert found.ring_bytes == pytest.approx(3 / 4 * 4 * 128 * 256 * 4)


def test_an_async_collective_split_into_start_continuation_and_done_counts_once():
    """The TPU compiler's async collectives: a start fusion, continuation fusions and a done fusion,
    each holding a copy of the all-gather with the same channel_id; one all-gather moves the bytes."""
    copy = (
        "  %{name} = bf16[4,32,64]{{2,1,0}} all-gather(%p), channel_id=9, replica_groups=[2,4]<=[8], "
        'dimensions={{1}}, metadata={{op_name="jit(step)/layers/attn/dot_general"}}'
    )
    parts = ["start", "continue.1", "continue.2", "done"]
    text = "\n".join(
        f"%{part} (p: bf16[4,8,64]) -> bf16[4,32,64] {{\n  %p = bf16[4,8,64]{{2,1,0}} parameter(0)\n"
        f"{copy.format(name='all-gather.' + str(i))}\n}}\n"
        for i, part in enumerate(parts)
    )
    calls = "\n".join(
        f"  %f{i} = bf16[4,32,64]{{2,1,0}} fusion(%a), kind=kCustom, calls=%{p}" for i, p in enumerate(parts)
    )
    entry = "ENTRY %main (a: bf16[4,8,64]) -> bf16[4,32,64] {\n  %a = bf16[4,8,64]{2,1,0} parameter(0)\n"
    text += f"\n{entry}{calls}\n}}\n"
    (found,) = hlo.collectives(text, num_devices=8)
    assert found.kind == "all-gather" and found.executions == 1 and found.result_bytes == 4 * 32 * 64 * 2
    assert hlo.summarize([found])["all-gather"]["count"] == 1


def test_gpu_async_collectives_count_the_results_their_done_returns():
    """XLA's GPU compiler returns a combined start's operands beside its results,
    ((operands...), (results...)); the done instruction returns the results alone. Counting the
    start's whole tuple made a reduce-scatter eight times too large on 8 devices."""
    text = """\
ENTRY %main (a: bf16[2048,64], b: f32[2048], c: bf16[256,64]) -> bf16[256,64] {
  %a = bf16[2048,64]{1,0} parameter(0)
  %b = f32[2048]{0} parameter(1)
  %c = bf16[256,64]{1,0} parameter(2)
  %rs-start = ((bf16[2048,64]{1,0}, f32[2048]{0}), (bf16[256,64]{1,0}, f32[256]{0})) reduce-scatter-start(%a, %b), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  %rs-done = (bf16[256,64]{1,0}, f32[256]{0}) reduce-scatter-done(%rs-start)
  %ag-start = ((bf16[256,64]{1,0}, bf16[256,64]{1,0}), (bf16[2048,64]{1,0}, bf16[2048,64]{1,0})) all-gather-start(%c, %c), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %ag-done = (bf16[2048,64]{1,0}, bf16[2048,64]{1,0}) all-gather-done(%ag-start)
  %one-start = (bf16[256,64]{1,0}, bf16[2048,64]{1,0}) all-gather-start(%c), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  %one-done = bf16[2048,64]{1,0} all-gather-done(%one-start)
  ROOT %r = bf16[256,64]{1,0} get-tuple-element(%rs-done), index=0
}
"""  # noqa: E501
    found = {c.name: c for c in hlo.collectives(text, num_devices=8)}
    assert set(found) == {"rs-start", "ag-start", "one-start"}
    assert found["rs-start"].result_bytes == 256 * 64 * 2 + 256 * 4
    assert found["rs-start"].ring_bytes == 7 * (256 * 64 * 2 + 256 * 4)
    assert found["ag-start"].result_bytes == 2 * 2048 * 64 * 2
    assert found["one-start"].result_bytes == 2048 * 64 * 2


@pytest.mark.parametrize(
    "attributes, groups",
    [
        ("replica_groups={{0,2},{1,3}}, to_apply=%add", [(0, 2), (1, 3)]),
        ("replica_groups={}, to_apply=%add", [(0, 1, 2, 3)]),
        ("replica_groups=[2,2]<=[4], dimensions={0}", [(0, 1), (2, 3)]),
        ("replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", [(0, 2), (1, 3)]),
        ("replica_groups=mesh['x'=2,'y'=2] {'x'}, use_global_device_ids=true", [(0, 2), (1, 3)]),
        (
            "replica_groups=mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'y'}, dimensions={0}",
            [(0, 2), (1, 3)],
        ),
        ("source_target_pairs={{0,1},{1,2},{2,3}}", [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_replica_groups_in_every_spelling(attributes, groups):
    assert hlo.replica_groups(attributes, num_devices=4) == groups
    assert hlo.group_size(attributes, num_devices=4) == len(groups[0])


def test_groups_that_span_islands_say_how_many_and_how_thinly():
    """Two hosts of four: a group over devices 0-3 stays on host 0; {0,4} spans both hosts with one
    device on each; {0,1,4,5} spans both with two on each."""
    text = """\
ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %inside = f32[8]{0} all-reduce(%a), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  %dp = f32[8]{0} all-reduce(%a), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %pairs = f32[8]{0} all-reduce(%a), channel_id=3, replica_groups={{0,1,4,5},{2,3,6,7}}, to_apply=%add
  ROOT %r = f32[8]{0} add(%inside, %dp)
}
"""
    hosts = [0, 0, 0, 0, 1, 1, 1, 1]
    found = {c.name: (c.islands, c.per_island) for c in hlo.collectives(text, 8, hosts)}
    assert found == {"inside": (1, 0), "dp": (2, 1), "pairs": (2, 2)}
    assert {c.islands for c in hlo.collectives(text, 8)} == {1}  # no islands given


def test_device_islands_place_each_device_on_its_process_host():
    from types import SimpleNamespace

    def devices(platform, processes):
        return [SimpleNamespace(platform=platform, process_index=p) for p in processes]

    # SLURM: one process per GPU, four processes on each of two hosts.
    gpus = devices("gpu", range(8))
    assert hlo.device_islands(gpus, [0, 0, 0, 0, 1, 1, 1, 1]) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert hlo.device_islands(gpus, [0] * 8) is None  # all on one host
    assert hlo.device_islands(devices("gpu", [0, 0, 1, 1])) == [0, 0, 1, 1]  # no hosts given: a process each
    assert hlo.device_islands(devices("cpu", [0, 1]), [0, 1]) == [0, 1]
    # A TPU program names its transfers between slices itself.
    assert hlo.device_islands(devices("tpu", [0, 1]), [0, 1]) is None


def test_megascale_sends_are_the_dcn_collectives_of_a_multi_slice_program():
    """Written as the TPU compiler writes them for two slices of four devices: an all-reduce's send
    and recv share a rendezvous name and shape; an all-gather's recv is the slices' pieces together."""
    attrs = (
        "is_host_transfer=true, frontend_attributes="
        '{{_xla_host_transfer_handler_name="xla_megascale_runtime",'
        '_xla_host_transfer_rendezvous="{name}",_xla_megascale_target="{{1,2}}x{{0:3}}",'
        '_xla_megascale_transfer_type="{kind}"}}'
    )
    text = f"""\
%body (p: (s32[], f32[16,8,128])) -> (s32[], f32[16,8,128]) {{
  %p = (s32[], f32[16,8,128]{{2,1,0}}) parameter(0)
  %v = f32[16,8,128]{{2,1,0}} get-tuple-element(%p), index=1
  %after-all.1 = token[] after-all()
  %send.1 = (f32[16,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) send(%v, %after-all.1), channel_id=6, {attrs.format(name="all-reduce.5_0", kind="ALL_REDUCE")}
  %recv.1 = (f32[16,8,128]{{2,1,0:T(8,128)}}, u32[], token[]) recv(%after-all.1), channel_id=5, {attrs.format(name="all-reduce.5_0", kind="ALL_REDUCE")}
  %send-done.1 = token[] send-done(%send.1), channel_id=6, {attrs.format(name="all-reduce.5_0", kind="ALL_REDUCE")}
  ROOT %t = (s32[], f32[16,8,128]{{2,1,0}}) tuple(%i, %v)
}}

ENTRY %main (a: f32[1,64]) -> f32[2,64] {{
  %a = f32[1,64]{{1,0}} parameter(0)
  %w = (s32[], f32[16,8,128]{{2,1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  %after-all.2 = token[] after-all()
  %send.2 = (f32[1,64]{{1,0}}, u32[], token[]) send(%a, %after-all.2), channel_id=8, {attrs.format(name="all-gather.7_0", kind="ALL_GATHER")}
  %recv.2 = (f32[2,64]{{1,0}}, u32[], token[]) recv(%after-all.2), channel_id=7, {attrs.format(name="all-gather.7_0", kind="ALL_GATHER")}
  ROOT %r = f32[2,64]{{1,0}} get-tuple-element(%recv.2), index=0
}}
"""  # noqa: E501
    found = {c.name: c for c in hlo.collectives(text, num_devices=4)}
    assert set(found) == {"send.1", "send.2"}
    reduce, gather = found["send.1"], found["send.2"]
    assert (reduce.kind, reduce.group_size, reduce.executions, reduce.islands) == ("all-reduce", 2, 3, 2)
    assert reduce.result_bytes == 16 * 8 * 128 * 4 and reduce.ring_bytes == reduce.result_bytes
    assert (gather.kind, gather.result_bytes, gather.ring_bytes) == ("all-gather", 2 * 64 * 4, 64 * 4)
