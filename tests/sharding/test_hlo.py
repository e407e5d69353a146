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


def test_a_shard_maps_collectives_count_one_by_one():
    """XLA gives a shard_map's collectives one channel_id (XLA:CPU and the TPU compiler alike): two
    all-gathers of one shape, one after the other, and a reduce-scatter are three collectives (the
    reader had counted one per channel_id, as for the TPU's copies above)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("x",), (jax.sharding.AxisType.Auto,))

    def f(a):
        b = jax.lax.all_gather(a, "x", tiled=True)
        c = jax.lax.all_gather(jnp.sin(b[:1]), "x", tiled=True)
        return jax.lax.psum_scatter(c, "x", tiled=True)

    mapped = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("x")))
    text = jax.jit(mapped).lower(x).compile().as_text()
    found = hlo.collectives(text, 8)
    assert sorted(c.kind for c in found) == ["all-gather", "all-gather", "reduce-scatter"], text


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


# fmt: off
SCHEDULED = """\
HloModule m, is_scheduled=true

%fused_dot (p0: f32[64,32], p1: f32[32,16]) -> f32[64,16] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  ROOT %d = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[64,32], w: f32[32,16]) -> f32[64,64] {
  %a = f32[64,32]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  %hid-start = (f32[64,32]{1,0}, f32[64,128]{1,0}) all-gather-start(%a), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}
  %mm = f32[64,16]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_dot
  %hid-done = f32[64,128]{1,0} all-gather-done(%hid-start)
  %bare-start = (f32[64,16]{1,0}, f32[64,64]{1,0}) all-gather-start(%mm), channel_id=2, replica_groups=[2,4]<=[8], dimensions={1}
  %gte = f32[64,16]{1,0} get-tuple-element(%bare-start), index=0
  %bare-done = f32[64,64]{1,0} all-gather-done(%bare-start)
  %sync = f32[64,64]{1,0} all-reduce(%bare-done), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %r = f32[64,64]{1,0} add(%sync, %sync)
}
"""  # noqa: E501
# fmt: on


def test_schedule_window_an_async_gather_with_a_product_between_start_and_done_is_hidden():
    found = {c.name: c for c in hlo.collectives(SCHEDULED, num_devices=8)}
    assert found["hid-start"].window == ("mm",) and found["hid-start"].hidden
    assert found["hid-start"].scheduled_in == "main"
    # Back to back (a get-tuple-element between computes nothing), and synchronous: exposed.
    assert found["bare-start"].window == () and not found["bare-start"].hidden
    assert found["sync"].window == () and not found["sync"].hidden
    split = hlo.exposure(list(found.values()))
    assert split["hidden"] == pytest.approx(found["hid-start"].ring_bytes)
    assert split["exposed"] == pytest.approx(found["bare-start"].ring_bytes + found["sync"].ring_bytes)


def test_schedule_window_of_the_tpus_start_continuation_and_done_fusions():
    """A copy of the collective in each of three fusions (one channel): the window runs from the
    start fusion to the done fusion, a continuation is not compute, a product between them is."""
    gather = (
        "  %{name} = bf16[4,32]{{1,0}} all-gather(%p), channel_id=9, replica_groups=[2,4]<=[8], "
        "dimensions={{1}}"
    )
    parts = ["start", "cont", "done"]
    text = "".join(
        f"%{part} (p: bf16[4,8]) -> bf16[4,32] {{\n  %p = bf16[4,8]{{1,0}} parameter(0)\n"
        f"{gather.format(name='all-gather.' + part)}\n}}\n\n"
        for part in parts
    )
    text += SCHEDULED.split("ENTRY")[0].split("\n", 2)[2]  # %fused_dot
    text += """ENTRY %main (a: bf16[4,8], x: f32[64,32], w: f32[32,16]) -> bf16[4,32] {
  %a = bf16[4,8]{1,0} parameter(0)
  %x = f32[64,32]{1,0} parameter(1)
  %w = f32[32,16]{1,0} parameter(2)
  %f0 = bf16[4,32]{1,0} fusion(%a), kind=kCustom, calls=%start
  %f1 = bf16[4,32]{1,0} fusion(%f0), kind=kCustom, calls=%cont
  %mm = f32[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  ROOT %f2 = bf16[4,32]{1,0} fusion(%f1), kind=kCustom, calls=%done
}
"""
    (found,) = hlo.collectives(text, num_devices=8)
    assert found.window == ("mm",) and found.scheduled_in == "main"
    back_to_back = text.replace(
        "  %mm = f32[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot\n", ""
    )
    (found,) = hlo.collectives(back_to_back, num_devices=8)
    assert found.window == ()
    # A continuation fusion that carries the gather's progress beside a product of its own computes.
    computing = back_to_back.replace(
        "  %all-gather.cont = ",
        "  %q = bf16[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={0}, rhs_contracting_dims={0}\n"
        "  %all-gather.cont = ",
    )
    (found,) = hlo.collectives(computing, num_devices=8)
    assert found.window == ("f1",)


def test_instruction_costs_count_products_in_fusions_and_loops():
    from gspmd_tp.sharding import hlo_cost

    costs = hlo_cost.Costs(SCHEDULED)
    index = [name for name, *_ in costs.parsed["main"]].index("mm")
    flops, moved = costs.flops_and_bytes("main", index)
    assert flops == 2 * 64 * 16 * 32 and moved == (64 * 32 + 32 * 16 + 64 * 16) * 4
    # The collectives cost nothing here; the add reads two operands and writes one.
    total, per = costs.seconds(lambda f, b: f + b)
    assert per["main", "hid-start"] == per["main", "sync"] == 0
    assert per["main", "r"] == 3 * 64 * 64 * 4
    assert total == pytest.approx(flops + moved + 3 * 64 * 64 * 4)
    # A loop costs its body times its trip count (3 and 5 for PROGRAM's two loops).
    program = PROGRAM.replace(
        "  ROOT %t = (s32[], f32[8]{0}) tuple(%i2, %ar)",
        "  %y = f32[8]{0} negate(%ar)\n  ROOT %t = (s32[], f32[8]{0}) tuple(%i2, %y)",
    )
    looped, _ = hlo_cost.Costs(program).seconds(lambda f, b: f + b)
    assert looped == (3 + 5) * 2 * 8 * 4


def test_a_cublas_gemm_custom_call_counts_its_flops():
    from gspmd_tp.sharding import hlo_cost

    text = """\
ENTRY %main (a: bf16[32,64], b: bf16[64,16]) -> bf16[32,16] {
  %a = bf16[32,64]{1,0} parameter(0)
  %b = bf16[64,16]{1,0} parameter(1)
  ROOT %g = (bf16[32,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}
"""  # noqa: E501
    flops, moved = hlo_cost.Costs(text).flops_and_bytes("main", 2)
    assert flops == 2 * 32 * 16 * 64 and moved == (32 * 64 + 64 * 16 + 32 * 16) * 2 + 1024
