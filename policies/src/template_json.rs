//! JSON in chat templates as Hugging Face renders it: request JSON (tool definitions, tool-call
//! arguments) becomes template values with its keys in the client's order, as Python dicts keep
//! them, and the `tojson` filter prints values as `transformers` does
//! (`json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=False)`):
//! `", "` and `": "` between items, non-ASCII text as is, no HTML escaping, floats with a
//! fractional part.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Error, ErrorKind};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

/// A JSON object with its keys in document order.
#[derive(Debug)]
struct OrderedMap(Vec<(String, Value)>);

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| Value::from(k.as_str())).collect())
    }
}

/// A template value parsed from JSON, objects in document order.
struct Ordered(Value);

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("JSON")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Ordered, E> {
                Ok(Ordered(Value::from(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Ordered, E> {
                Ok(Ordered(Value::from(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Ordered, E> {
                Ok(Ordered(Value::from(v)))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Ordered, E> {
                Ok(Ordered(Value::from(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Ordered, E> {
                Ok(Ordered(Value::from(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Ordered, E> {
                Ok(Ordered(Value::from(())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Ordered, A::Error> {
                let mut out = Vec::new();
                while let Some(Ordered(v)) = seq.next_element()? {
                    out.push(v);
                }
                Ok(Ordered(Value::from(out)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ordered, A::Error> {
                let mut out: Vec<(String, Value)> = Vec::new();
                while let Some((k, Ordered(v))) = map.next_entry::<String, Ordered>()? {
                    // A repeated key keeps its first position and its last value, as in Python.
                    match out.iter_mut().find(|(n, _)| *n == k) {
                        Some(slot) => slot.1 = v,
                        None => out.push((k, v)),
                    }
                }
                Ok(Ordered(Value::from_object(OrderedMap(out))))
            }
        }
        d.deserialize_any(V)
    }
}

/// Parse JSON text into a template value, objects keeping their key order.
pub fn parse(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str::<Ordered>(text).map(|o| o.0)
}

/// Write `s` as a JSON string, non-ASCII kept (`ensure_ascii=False`).
fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn newline(out: &mut String, indent: Option<usize>, depth: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

/// Python's `json.dumps` of a template value.
fn dump(out: &mut String, v: &Value, indent: Option<usize>, depth: usize) -> Result<(), Error> {
    // With an indent, Python separates items with "," and a newline; without, with ", ".
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                // i64 or u64, as written.
                let _ = write!(out, "{v}");
            } else {
                let f = f64::try_from(v.clone())?;
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else if f.is_finite() {
                    let _ = write!(out, "{f}");
                } else {
                    return Err(Error::new(ErrorKind::InvalidOperation, "tojson: not a finite number"));
                }
            }
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default()),
        // A sequence's items, or a map's keys (each followed by its value).
        ValueKind::Seq | ValueKind::Iterable | ValueKind::Map => {
            let map = v.kind() == ValueKind::Map;
            let items: Vec<Value> = v.try_iter()?.collect();
            let (open, close) = if map { ('{', '}') } else { ('[', ']') };
            out.push(open);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, depth + 1);
                if map {
                    write_str(out, &item.to_string());
                    out.push_str(": ");
                    dump(out, &v.get_item(item)?, indent, depth + 1)?;
                } else {
                    dump(out, item, indent, depth + 1)?;
                }
            }
            if !items.is_empty() {
                newline(out, indent, depth);
            }
            out.push(close);
        }
        _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize {}", v.kind()))),
    }
    Ok(())
}

/// The `tojson` filter of Hugging Face's chat templates (`indent` supported).
pub fn tojson(v: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    dump(&mut out, v, indent, 0)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, value: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.add_template("t", src).unwrap();
        env.get_template("t").unwrap().render(minijinja::context! { v => value }).unwrap()
    }

    /// The expected strings are Python's:
    /// `json.dumps(json.loads(TEXT), ensure_ascii=False)` and with `indent=2`.
    #[test]
    fn tojson_prints_what_python_prints_in_document_order() {
        let text = r#"{"type": "object", "properties": {"path": {"type": "string", "description": "Grüße é 中文 \"q\"\n"}}, "required": ["path"], "n": 1.0, "m": 2.5, "k": -3, "z": null, "b": true, "e": {}, "l": []}"#;
        let v = parse(text).unwrap();
        assert_eq!(
            render("{{ v | tojson }}", v.clone()),
            r#"{"type": "object", "properties": {"path": {"type": "string", "description": "Grüße é 中文 \"q\"\n"}}, "required": ["path"], "n": 1.0, "m": 2.5, "k": -3, "z": null, "b": true, "e": {}, "l": []}"#
        );
        assert_eq!(
            render("{{ v | tojson(indent=2) }}", parse(r#"{"a": [1, {"b": "c"}], "d": {}}"#).unwrap()),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"c\"\n    }\n  ],\n  \"d\": {}\n}"
        );
        // Templates read the values and iterate the keys in the client's order.
        assert_eq!(
            render("{% for k in v %}{{ k }},{% endfor %}{{ v.properties.path.type }}", v),
            "type,properties,required,n,m,k,z,b,e,l,string"
        );
        assert_eq!(render("{{ v | tojson }}", Value::from("<&'>")), r#""<&'>""#, "no HTML escaping");
    }
}
