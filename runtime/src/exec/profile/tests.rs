use super::*;

fn iv(spans: &[(f64, f64)]) -> Vec<(TaskId, f64, f64)> {
    spans
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| (TaskId(i as u32), a, b))
        .collect()
}

#[test]
fn steps_are_alone_beside_one_kind_or_mixed() {
    use StepSide::*;
    let (r, a) = (WorkKind::RefPrefix, WorkKind::ActorPrefixFwd);
    // 8 steps of 1 s; ref prefixes back to back over [0.5, 3.0] and [3.0, 4.0], an actor
    // prefix over [4.0, 5.5], then nothing
    let marks: Vec<f64> = (0..=8).map(f64::from).collect();
    let others = [(r, 0.5, 3.0), (r, 3.0, 4.0), (a, 4.0, 5.5)];
    assert_eq!(
        classify_steps(&marks, &others),
        vec![
            Mixed,
            Beside(r),
            Beside(r),
            Beside(r),
            Beside(a),
            Mixed,
            Alone,
            Alone
        ]
    );
    // two kinds in one step; a gap inside a step; touching ends
    let two = [(r, 0.0, 0.5), (a, 0.5, 1.0)];
    assert_eq!(classify_steps(&[0.0, 1.0], &two), vec![Mixed]);
    let gap = [(r, 0.0, 0.4), (r, 0.6, 1.0)];
    assert_eq!(classify_steps(&[0.0, 1.0], &gap), vec![Mixed]);
    let touch = [(r, 1.0, 2.0)];
    assert_eq!(
        classify_steps(&[0.0, 1.0, 2.0], &touch),
        vec![Alone, Beside(r)]
    );
    assert!(classify_steps(&[1.0], &others).is_empty());
}

#[test]
fn median_of_odd_and_even_counts() {
    assert_eq!(median(&[]), None);
    assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
    assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
}

#[test]
fn overlapping_intervals_are_not_alone() {
    // 0 alone; 1 and 2 overlap; 3 touches 2's end (alone); 4 lies inside 5
    let spans = [
        (0.0, 1.0),
        (1.0, 3.0),
        (2.0, 4.0),
        (4.0, 5.0),
        (6.5, 7.0),
        (6.0, 9.0),
    ];
    let got = alone_flags(&iv(&spans), Execution::Partitioned);
    assert_eq!(got, vec![true, false, false, true, false, false]);
    // a long task overlapping a later short one that starts after an intermediate one
    let spans = [(0.0, 10.0), (1.0, 2.0), (3.0, 4.0), (11.0, 12.0)];
    let got = alone_flags(&iv(&spans), Execution::Shared);
    assert_eq!(got, vec![false, false, false, true]);
    assert!(alone_flags(&iv(&spans), Execution::OneAtATime)
        .iter()
        .all(|&a| a));
}

#[test]
fn plans_of_one_file_name_get_distinct_file_stems() {
    let stems = plan_file_stems(&[
        "a/serial.plan.bin",
        "b/serial.plan.bin",
        "b/overlap.plan.bin",
        "x",
    ]);
    assert_eq!(
        stems,
        ["serial.plan.p0", "serial.plan.p1", "overlap.plan", "x"]
    );
}
