//! HLO text for humans: `%add.12 = f32[4,64]{1,0} add(%a.3, %b.7)`, one instruction per line,
//! computations callees first, in the spirit of XLA's own printer (not a byte-exact copy of it).

use std::collections::HashMap;
use std::fmt::Write;

use super::opcodes;
use super::proto::{HloModuleProto, PrimitiveType, ShapeProto};

fn shape_text(s: &ShapeProto) -> String {
    let t = PrimitiveType::try_from(s.element_type).unwrap_or(PrimitiveType::Invalid);
    if t == PrimitiveType::Tuple {
        let parts: Vec<String> = s.tuple_shapes.iter().map(shape_text).collect();
        return format!("({})", parts.join(", "));
    }
    let dims: Vec<String> = s.dimensions.iter().map(|d| d.to_string()).collect();
    let layout = s
        .layout
        .as_ref()
        .map(|l| {
            format!(
                "{{{}}}",
                l.minor_to_major
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            )
        })
        .unwrap_or_default();
    format!(
        "{}[{}]{}",
        t.as_str_name().to_lowercase(),
        dims.join(","),
        if dims.is_empty() {
            String::new()
        } else {
            layout
        }
    )
}

/// Renders a module as text.
pub fn render(m: &HloModuleProto) -> String {
    let mut names: HashMap<i64, String> = HashMap::new();
    for c in &m.computations {
        names.insert(c.id, c.name.clone());
        for i in &c.instructions {
            names.insert(i.id, i.name.clone());
        }
    }
    let mut out = format!("HloModule {}\n", m.name);
    for c in &m.computations {
        let entry = if c.id == m.entry_computation_id {
            "ENTRY "
        } else {
            ""
        };
        let _ = writeln!(out, "\n{entry}%{} {{", c.name);
        for i in &c.instructions {
            let root = if i.id == c.root_id { "ROOT " } else { "" };
            let ops: Vec<String> = i
                .operand_ids
                .iter()
                .map(|o| format!("%{}", names.get(o).cloned().unwrap_or_default()))
                .collect();
            let mut attrs = Vec::new();
            if i.opcode == opcodes::PARAMETER {
                attrs.push(format!("{}", i.parameter_number));
            }
            if !i.dimensions.is_empty() {
                attrs.push(format!(
                    "dimensions={{{}}}",
                    i.dimensions
                        .iter()
                        .map(|d| d.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ));
            }
            if !i.replica_groups.is_empty() {
                let groups: Vec<String> = i
                    .replica_groups
                    .iter()
                    .map(|g| {
                        let ids: Vec<String> =
                            g.replica_ids.iter().map(|r| r.to_string()).collect();
                        format!("{{{}}}", ids.join(","))
                    })
                    .collect();
                attrs.push(format!("replica_groups={{{}}}", groups.join(",")));
            }
            if !i.comparison_direction.is_empty() {
                attrs.push(format!("direction={}", i.comparison_direction));
            }
            if !i.called_computation_ids.is_empty() {
                let called: Vec<String> = i
                    .called_computation_ids
                    .iter()
                    .map(|c| format!("%{}", names.get(c).cloned().unwrap_or_default()))
                    .collect();
                attrs.push(format!("calls={}", called.join(",")));
            }
            if let Some(fa) = &i.frontend_attributes {
                let kv: Vec<String> = fa.map.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
                attrs.push(format!("frontend_attributes={{{}}}", kv.join(",")));
            }
            if let Some(l) = &i.literal {
                if l.f32s.len() == 1 {
                    attrs.push(format!("value={}", l.f32s[0]));
                } else if l.s32s.len() == 1 {
                    attrs.push(format!("value={}", l.s32s[0]));
                } else if l.u32s.len() == 1 {
                    attrs.push(format!("value={}", l.u32s[0]));
                }
            }
            let shape = i.shape.as_ref().map(shape_text).unwrap_or_default();
            let mut args = ops.join(", ");
            if !attrs.is_empty() {
                if !args.is_empty() {
                    args.push_str(", ");
                }
                args.push_str(&attrs.join(", "));
            }
            let _ = writeln!(out, "  {root}%{} = {shape} {}({args})", i.name, i.opcode);
        }
        out.push_str("}\n");
    }
    if let Some(a) = &m.input_output_alias {
        for e in &a.entries {
            let _ = writeln!(
                out,
                "// output {:?} must-alias parameter {}",
                e.output_shape_index, e.parameter_number
            );
        }
    }
    out
}
