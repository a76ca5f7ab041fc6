//! The JSON Schema compiler: what it keeps, what it reports, and that real schemas never crash
//! it.

mod common;

use quarry_grammar::json::{compile_schema, KeywordStatus, Node, SchemaGraph, SchemaOptions};
use quarry_grammar::GrammarError;
use serde_json::json;

fn lenient() -> SchemaOptions {
    SchemaOptions {
        strict: false,
        ..Default::default()
    }
}

#[test]
fn every_keyword_is_reported_with_its_pointer() {
    let schema = json!({
        "title": "Invoice",
        "type": "object",
        "properties": {
            "number": {"type": "string", "pattern": "^INV-[0-9]+$", "description": "id"},
            "total": {"type": "number", "minimum": 0, "multipleOf": 0.01},
            "count": {"type": "integer", "multipleOf": 5, "maximum": 1e300},
            "ratio": {"type": "number", "exclusiveMaximum": 1.5},
            "lines": {"type": "array", "items": {"type": "object"}, "uniqueItems": true, "minItems": 1},
            "currency": {"enum": ["EUR", "USD"]},
            "note": {"type": ["string", "null"], "format": "hexcolor", "x-ui": "textarea"}
        },
        "required": ["number", "total"],
        "additionalProperties": false,
        "not": {"required": ["legacy"]}
    });
    let (graph, report) = compile_schema(&schema, &lenient()).unwrap();
    let status = |p: &str, k: &str| {
        report
            .status_of(p, k)
            .cloned()
            .unwrap_or_else(|| panic!("{p} {k} not reported"))
    };
    assert_eq!(status("", "title"), KeywordStatus::Annotation);
    assert_eq!(status("", "required"), KeywordStatus::Enforced);
    assert_eq!(status("/properties/number", "pattern"), KeywordStatus::Enforced);
    assert_eq!(status("/properties/number", "description"), KeywordStatus::Annotation);
    assert_eq!(status("/properties/total", "minimum"), KeywordStatus::Enforced);
    assert!(
        matches!(status("/properties/total", "multipleOf"), KeywordStatus::Rejected(_)),
        "a fractional step is not enforced, and the report says so"
    );
    assert_eq!(status("/properties/count", "multipleOf"), KeywordStatus::Enforced);
    assert_eq!(status("/properties/count", "maximum"), KeywordStatus::Enforced);
    assert_eq!(status("/properties/ratio", "exclusiveMaximum"), KeywordStatus::Enforced);
    assert!(matches!(
        status("/properties/lines", "uniqueItems"),
        KeywordStatus::Rejected(_)
    ));
    assert!(matches!(
        status("/properties/note", "format"),
        KeywordStatus::Approximated(_)
    ));
    assert_eq!(status("/properties/note", "x-ui"), KeywordStatus::Annotation);
    assert!(matches!(status("", "not"), KeywordStatus::Rejected(_)));
    assert!(!report.fully_enforced());

    let Node::Object(root) = graph.node(graph.root) else {
        panic!("root is an object")
    };
    assert_eq!(root.required, vec!["number", "total"]);
    assert_eq!(graph.node(root.additional), &Node::Never);
    let names: Vec<&str> = root.properties.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["number", "total", "count", "ratio", "lines", "currency", "note"],
        "schema order is kept"
    );
    let note = root.properties[6].1;
    assert!(
        matches!(graph.node(note), Node::AnyOf(alts) if alts.len() == 2),
        "type array is a union"
    );

    // Strict mode refuses the same schema, naming the first keyword it cannot enforce.
    match compile_schema(&schema, &SchemaOptions::default()) {
        Err(GrammarError::Unsupported { pointer, keyword, .. }) => {
            assert!(
                ["/properties/total", "/properties/lines", ""].contains(&pointer.as_str()),
                "{pointer}"
            );
            assert!(
                ["multipleOf", "uniqueItems", "not"].contains(&keyword.as_str()),
                "{keyword}"
            );
        }
        other => panic!("{other:?}"),
    }
}

fn reachable(graph: &SchemaGraph, from: u32, target: u32) -> bool {
    let mut seen = vec![false; graph.nodes.len()];
    let mut stack = vec![from];
    while let Some(id) = stack.pop() {
        let children: Vec<u32> = match graph.node(id) {
            Node::AnyOf(a) => a.clone(),
            Node::Array(a) => a.prefix.iter().copied().chain([a.items]).collect(),
            Node::Object(o) => o
                .properties
                .iter()
                .map(|p| p.1)
                .chain(o.pattern_properties.iter().map(|p| p.1))
                .chain([o.additional])
                .collect(),
            _ => vec![],
        };
        for c in children {
            if c == target {
                return true;
            }
            if !seen[c as usize] {
                seen[c as usize] = true;
                stack.push(c);
            }
        }
    }
    false
}

#[test]
fn recursion_becomes_a_cycle_and_bad_references_are_typed_errors() {
    let tree = json!({
        "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}
        }}},
        "$ref": "#/$defs/node"
    });
    let (graph, report) = compile_schema(&tree, &SchemaOptions::default()).unwrap();
    assert!(report.fully_enforced(), "{:?}", report.keywords);
    let Node::AnyOf(alias) = graph.node(graph.root) else {
        panic!()
    };
    assert!(reachable(&graph, alias[0], alias[0]), "the node schema contains itself");

    let missing = json!({"properties": {"a": {"$ref": "#/definitions/nope"}}});
    match compile_schema(&missing, &lenient()) {
        Err(GrammarError::InvalidSchema { pointer, keyword, .. }) => {
            assert_eq!((pointer.as_str(), keyword.as_str()), ("/properties/a", "$ref"))
        }
        other => panic!("{other:?}"),
    }
    let remote = json!({"$ref": "https://example.com/schema.json"});
    assert!(matches!(
        compile_schema(&remote, &lenient()),
        Err(GrammarError::InvalidSchema { .. })
    ));
    assert!(matches!(
        compile_schema(&json!({"type": 3}), &lenient()),
        Err(GrammarError::InvalidSchema { .. })
    ));
    assert!(matches!(
        compile_schema(&json!({"minLength": -1, "type": "string"}), &lenient()),
        Err(GrammarError::InvalidSchema { .. })
    ));
    // A pattern that is no regex at all is an error even when compiling leniently; one that
    // merely cannot be enforced (a backreference) is reported and skipped.
    let broken = json!({"properties": {"code": {"type": "string", "pattern": "([A-Z]+"}}});
    match compile_schema(&broken, &lenient()) {
        Err(GrammarError::InvalidSchema { pointer, keyword, .. }) => {
            assert_eq!((pointer.as_str(), keyword.as_str()), ("/properties/code", "pattern"))
        }
        other => panic!("{other:?}"),
    }
    let unenforceable = json!({"type": "string", "pattern": "(a)\\1"});
    assert!(compile_schema(&unenforceable, &lenient()).is_ok());
}

#[test]
fn unions_and_intersections() {
    let one_of_kinds = json!({"oneOf": [{"type": "string"}, {"type": "integer"}]});
    let (_, r) = compile_schema(&one_of_kinds, &SchemaOptions::default()).unwrap();
    assert_eq!(
        r.status_of("", "oneOf"),
        Some(&KeywordStatus::Enforced),
        "different kinds never overlap"
    );
    let one_of_objects = json!({"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]});
    let (_, r) = compile_schema(&one_of_objects, &lenient()).unwrap();
    assert!(matches!(r.status_of("", "oneOf"), Some(KeywordStatus::Approximated(_))));

    let all_of = json!({"allOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"properties": {"b": {"type": "integer", "maximum": 5}}, "required": ["b"]},
        {"properties": {"b": {"minimum": 1}}}
    ]});
    let (graph, r) = compile_schema(&all_of, &SchemaOptions::default()).unwrap();
    // Each part is reported as compiled on its own, before the merge: `{"minimum": 1}` alone is
    // a number bound (approximated) even though the merged node below is an exact integer range.
    // The report may say less than is enforced, never more.
    assert_eq!(r.rejected().count(), 0, "{:?}", r.keywords);
    let Node::Object(o) = graph.node(graph.root) else {
        panic!("{:?}", graph.node(graph.root))
    };
    assert_eq!(o.required, vec!["a", "b"]);
    let b = o.properties.iter().find(|p| p.0 == "b").unwrap().1;
    let Node::Integer(rules) = graph.node(b) else {
        panic!("{:?}", graph.node(b))
    };
    assert_eq!((rules.minimum, rules.maximum), (Some(1.0), Some(5.0)));
    assert_eq!(
        compile_schema(&json!({"allOf": [{"type": "string"}, {"type": "integer"}]}), &lenient())
            .unwrap()
            .0
            .nodes
            .last(),
        Some(&Node::Never)
    );
}

/// Every real-world schema of the corpus compiles or fails with a typed error; none panics.
#[test]
fn the_maskbench_corpus_never_crashes_the_compiler() {
    let Some(corpus) = common::corpus() else { return };
    let (mut ok, mut strict_ok, mut errors) = (0, 0, std::collections::BTreeMap::<String, usize>::new());
    for entry in corpus {
        let schema = &entry["schema"];
        match compile_schema(schema, &lenient()) {
            Ok(_) => ok += 1,
            Err(e) => *errors.entry(format!("{:?}", std::mem::discriminant(&e))).or_default() += 1,
        }
        strict_ok += compile_schema(schema, &SchemaOptions::default()).is_ok() as usize;
    }
    eprintln!("lenient: {ok} compiled; strict: {strict_ok} compiled; errors: {errors:?}");
    assert!(ok > 7000, "only {ok} of the corpus compiled leniently");
}

/// Under `close_objects`, an object that declares properties and says nothing of
/// `additionalProperties` takes no other key, and the report says where; objects that declare
/// nothing, that say `additionalProperties` or `unevaluatedProperties`, and the properties an
/// `allOf` part declares for its sibling are left alone.
#[test]
fn objects_that_declare_properties_are_closed_on_request() {
    let schema = json!({
        "type": "object",
        "properties": {
            "person": {"type": "object", "properties": {"name": {"type": "string"}}},
            "meta": {"type": "object"},
            "open": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": true},
            "eval": {"type": "object", "properties": {"b": {"type": "integer"}}, "unevaluatedProperties": false},
            "both": {"allOf": [
                {"type": "object", "properties": {"x": {"type": "integer"}}},
                {"type": "object", "properties": {"y": {"type": "integer"}}}
            ]}
        }
    });
    let options = SchemaOptions {
        close_objects: true,
        ..lenient()
    };
    let (graph, report) = compile_schema(&schema, &options).unwrap();
    let narrowed: Vec<&str> = report
        .keywords
        .iter()
        .filter(|k| matches!(k.status, KeywordStatus::Narrowed(_)))
        .map(|k| k.pointer.as_str())
        .collect();
    assert_eq!(
        narrowed,
        vec!["", "/properties/both/allOf/0", "/properties/person"],
        "{report:?}"
    );
    let object = |name: &str| {
        let Node::Object(root) = graph.node(graph.root) else {
            panic!()
        };
        let id = root.properties.iter().find(|(n, _)| n == name).unwrap().1;
        let mut id = id;
        while let Node::AnyOf(a) = graph.node(id) {
            id = a[0];
        }
        match graph.node(id) {
            Node::Object(r) => r.clone(),
            other => panic!("{name}: {other:?}"),
        }
    };
    let closed = |name: &str| matches!(graph.node(object(name).additional), Node::Never);
    assert!(closed("person"));
    assert!(!closed("meta") && !closed("open") && !closed("eval"));
    let both = object("both");
    assert!(closed("both"), "the merged object is closed");
    assert_eq!(both.properties.len(), 2, "with both parts' properties declared");
    // A required name the object does not declare stays writable once the object is closed.
    let promised = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]});
    let (promised, _) = compile_schema(&promised, &options).unwrap();
    let Node::Object(r) = promised.node(promised.root) else {
        panic!()
    };
    assert!(matches!(promised.node(r.additional), Node::Never));
    let b = r.properties.iter().find(|(n, _)| n == "b").expect("`b` is declared").1;
    assert!(
        matches!(promised.node(b), Node::Any),
        "with the schema the open object gave it"
    );

    let (graph, report) = compile_schema(&schema, &lenient()).unwrap();
    assert!(report
        .keywords
        .iter()
        .all(|k| !matches!(k.status, KeywordStatus::Narrowed(_))));
    let Node::Object(root) = graph.node(graph.root) else {
        panic!()
    };
    assert!(
        !matches!(graph.node(root.additional), Node::Never),
        "open without the option"
    );
}

/// A schema past the compile limits (time, automata memory) is a typed error naming the
/// limit, not a server busy for minutes.
#[test]
fn compile_time_and_memory_are_bounded_per_schema() {
    use quarry_grammar::json::{JsonGrammar, Whitespace};
    let fields: serde_json::Map<String, serde_json::Value> = (0..40)
        .map(|i| {
            (
                format!("f{i}"),
                json!({"type": "string", "pattern": format!("^[a-z]{{{i},{}}}[0-9]{{2,9}}$", i + 30)}),
            )
        })
        .collect();
    let schema = json!({"type": "object", "properties": fields});
    let vocab = quarry_grammar::TokenVocab::new((0..=255u8).map(|b| vec![b]).collect(), &[], &[]);
    let compile = |options: SchemaOptions| JsonGrammar::compile(&schema, &options, Whitespace::Compact, vocab.clone());
    assert!(compile(lenient()).is_ok());
    let reason = |r: Result<_, GrammarError>| match r {
        Err(GrammarError::TooLarge { what, reason }) => format!("{what}: {reason}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("compiled past its limit"),
    };
    let slow = reason(compile(SchemaOptions {
        max_compile_time: std::time::Duration::ZERO,
        ..lenient()
    }));
    assert_eq!(
        slow,
        "schema: compiling it takes longer than 0.0 s, the limit per schema"
    );
    let big = reason(compile(SchemaOptions {
        max_automata_bytes: 64 << 10,
        ..lenient()
    }));
    assert_eq!(
        big,
        "schema: its automata take more than 65536 bytes, the limit per schema"
    );
}
